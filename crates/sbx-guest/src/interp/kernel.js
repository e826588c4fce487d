// sbx's JavaScript kernel for the code interpreter (server.py): run by
// `node --expose-internals -e <this> CTL CMD`. Cells run in node's main context (vm), so
// variables, functions and required modules stay from one cell to the next; the value of a
// cell's last expression is its result (util.inspect); console output goes to stdout and
// stderr, read by the server as it is written (pipes are synchronous in node on Linux).
// Top-level await: node's own REPL rewrite (internal/repl/await) when it is there.
// Commands come one JSON line at a time on fd CMD; messages go on fd CTL.
'use strict';
const vm = require('vm');
const util = require('util');
const fs = require('fs');
const Module = require('module');
const path = require('path');

const [CTL, CMD] = process.argv.slice(-2).map(Number);
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
  let src = req.code;
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
