// sbx's JavaScript kernel for the code interpreter (server.py): run by
// `node --expose-internals -e <this> [typescript] CTL CMD`. Cells run in node's main context (vm), so
// variables, functions and required modules stay from one cell to the next; the value of a
// cell's last expression is its result (util.inspect); console output goes to stdout and
// stderr, read by the server as it is written (pipes are synchronous in node on Linux).
// Top-level await: node's own REPL rewrite (internal/repl/await) when it is there.
// Commands come one JSON line at a time on fd CMD; messages go on fd CTL.
// The kernel's own names are the function's: a cell's global ones (`fs`, `path`) are free.
(function kernel() {
'use strict';
const vm = require('vm');
const util = require('util');
const fs = require('fs');
const Module = require('module');
const path = require('path');

const [CTL, CMD] = process.argv.slice(-2).map(Number);
// `typescript` before them: cells are TypeScript.
const TS = process.argv.length > 3 && process.argv[process.argv.length - 3] === 'typescript';
let tsc = null; // Debian's node-typescript, when the image has it

function compiler() {
  if (tsc === null) {
    try {
      tsc = require('typescript');
    } catch (_) {
      tsc = false;
    }
  }
  return tsc;
}

// ESM `import` and `export` of a cell as CommonJS a vm script runs: `var`s of the cell's
// global scope (so that a name imported stays for the next cells, and a cell can run again).
function names(spec) {
  return spec
    .replace(/\btype\s+/g, '')
    .replace(/\s+as\s+/g, ': ')
    .replace(/,\s*$/, '');
}

function esmToCjs(src) {
  return src.replace(/^[ \t]*import\s+type\b[^;\n]*(\{[\s\S]*?\})?[^;\n]*[;\n]?/gm, '')
    .replace(/^([ \t]*)import\s+([\s\S]*?)\s+from\s+(['"][^'"]+['"])[ \t]*;?/gm, (_, ind, what, mod) => {
      const req = `require(${mod})`;
      const parts = [];
      let rest = what.trim();
      const def = /^([A-Za-z_$][\w$]*)\s*(,|$)/.exec(rest);
      if (def) {
        parts.push(`var ${def[1]} = __sbx_default(${req});`);
        rest = rest.slice(def[0].length).trim();
      }
      const star = /^\*\s+as\s+([A-Za-z_$][\w$]*)/.exec(rest);
      if (star) {
        parts.push(`var ${star[1]} = ${req};`);
      }
      const braces = /^\{([\s\S]*)\}$/.exec(rest);
      if (braces && names(braces[1]).trim()) {
        parts.push(`var {${names(braces[1])}} = ${req};`);
      }
      return ind + parts.join(' ');
    })
    .replace(/^([ \t]*)import\s+(['"][^'"]+['"])\s*;?/gm, (_, ind, mod) => `${ind}require(${mod});`)
    .replace(/^([ \t]*)export\s+(default\s+)?(?=(const|let|var|function|class|async)\b)/gm, '$1')
    .replace(/^([ \t]*)export\s+\{[^}]*\}\s*;?/gm, '$1');
}

globalThis.__sbx_default = (m) => (m && m.__esModule ? m.default : m);

// A cell as node's vm runs it: ESM made CommonJS, and TypeScript's types taken away by
// TypeScript's compiler (Debian's node-typescript) in a TypeScript context.
function transpile(src) {
  if (/^\s*(import|export)\b(?!\s*\()/m.test(src)) {
    src = esmToCjs(src);
  }
  if (!TS) {
    return src;
  }
  const ts = compiler();
  if (!ts) {
    throw new Error("TypeScript is not installed in this sandbox's image (Debian's node-typescript)");
  }
  return ts.transpileModule(src, {
    compilerOptions: { target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.ESNext, strict: false },
    reportDiagnostics: false,
  }).outputText;
}

let tla = null;
try {
  tla = require('internal/repl/await').processTopLevelAwait;
} catch (_) {
  tla = null;
}

function send(obj) {
  let data = Buffer.from(JSON.stringify(obj) + '\n');
  while (data.length) {
    data = data.subarray(fs.writeSync(CTL, data));
  }
}

globalThis.require = Module.createRequire(path.join(process.cwd(), '[cell]'));
globalThis.module = globalThis.module || { exports: {} };
globalThis.exports = globalThis.module.exports;
globalThis.__dirname = process.cwd();
globalThis.__filename = path.join(process.cwd(), '[cell]');

let current = null; // the cell running: {n, env, done}

function trimStack(stack) {
  const lines = String(stack).split('\n');
  const out = [];
  for (const l of lines) {
    if (/^\s+at /.test(l) && /\[eval\]|kernel\.js|node:internal\/|node:vm:/.test(l)) {
      break;
    }
    out.push(l);
  }
  return out.join('\n');
}

function errorMsg(e) {
  if (e instanceof Error || (e && typeof e === 'object' && 'stack' in e)) {
    return {
      type: 'error',
      name: String(e.name || 'Error'),
      value: String(e.message === undefined ? '' : e.message),
      traceback: trimStack(e.stack || ''),
    };
  }
  return { type: 'error', name: 'Error', value: util.inspect(e), traceback: 'Uncaught ' + util.inspect(e) };
}

function finish(cell, msg) {
  if (current !== cell) {
    return;
  }
  current = null;
  if (msg) {
    send(msg);
  }
  for (const [k, v] of Object.entries(cell.saved)) {
    if (v === undefined) {
      delete process.env[k];
    } else {
      process.env[k] = v;
    }
  }
  send({ type: 'done' });
  next();
}

function result(cell, value) {
  if (value === undefined) {
    finish(cell, null);
    return;
  }
  globalThis._ = value;
  let text;
  try {
    text = util.inspect(value);
  } catch (e) {
    finish(cell, errorMsg(e));
    return;
  }
  finish(cell, { type: 'result', main: true, data: { 'text/plain': text } });
}

function run(req) {
  const cell = { n: req.n, saved: {} };
  current = cell;
  for (const [k, v] of Object.entries(req.env || {})) {
    cell.saved[k] = process.env[k];
    process.env[k] = String(v);
  }
  let src;
  try {
    src = transpile(req.code);
  } catch (e) {
    finish(cell, errorMsg(e));
    return;
  }
  let wrapped = false;
  if (tla && /\bawait\b/.test(src)) {
    try {
      const w = tla(src);
      if (w) {
        src = w;
        wrapped = true;
      }
    } catch (_) {
      // Not something the rewrite understands: run it as it is.
    }
  }
  let value;
  try {
    value = vm.runInThisContext(src, { filename: `Cell In[${req.n}]`, breakOnSigint: true });
  } catch (e) {
    finish(cell, errorMsg(e));
    return;
  }
  if (!wrapped) {
    result(cell, value);
    return;
  }
  Promise.resolve(value).then(
    (r) => result(cell, r && typeof r === 'object' && 'value' in r ? r.value : undefined),
    (e) => finish(cell, errorMsg(e)),
  );
}

const pending = [];
function next() {
  if (current || !pending.length) {
    return;
  }
  const line = pending.shift();
  let req;
  try {
    req = JSON.parse(line);
  } catch (e) {
    send(errorMsg(e));
    send({ type: 'done' });
    next();
    return;
  }
  run(req);
}

process.on('SIGINT', () => {
  if (current) {
    finish(current, { type: 'error', name: 'Interrupted', value: 'the cell was interrupted', traceback: '' });
  }
});
process.on('uncaughtException', (e) => {
  process.stderr.write('Uncaught ' + (e && e.stack ? e.stack : util.inspect(e)) + '\n');
});
process.on('unhandledRejection', (e) => {
  process.stderr.write('Unhandled rejection: ' + (e && e.stack ? e.stack : util.inspect(e)) + '\n');
});

let buf = '';
const input = fs.createReadStream(null, { fd: CMD, encoding: 'utf8' });
input.on('data', (chunk) => {
  buf += chunk;
  let i;
  while ((i = buf.indexOf('\n')) >= 0) {
    pending.push(buf.slice(0, i));
    buf = buf.slice(i + 1);
  }
  next();
});
input.on('end', () => process.exit(0));
input.on('error', () => process.exit(0));
send({ type: 'ready', pid: process.pid });
})();
