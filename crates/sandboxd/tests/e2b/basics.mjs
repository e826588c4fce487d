// E2B's npm SDK (e2b, pinned by scripts/e2b-sdks.sh) against an sbx node, unchanged: only
// E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY point it at the node. Run by
// crates/sandboxd/tests/it/e2b.rs; exits non-zero at the first check that fails.
import { Sandbox, CommandExitError } from 'e2b'

function check(what, cond, detail = '') {
  if (!cond) {
    console.log(`FAILED: ${what} ${detail}`)
    process.exit(1)
  }
  console.log(`ok: ${what}`)
}

const s = await Sandbox.create({ metadata: { suite: 'npm' }, envs: { A: '1' }, timeoutMs: 120_000 })
check('create', s.sandboxId.startsWith('sbx-'), s.sandboxId)
try {
  const r = await s.commands.run('echo hi $A')
  check('run: stdout', r.stdout === 'hi 1\n' && r.exitCode === 0, JSON.stringify(r))
  try {
    await s.commands.run('exit 4')
    check('run: a failing command throws', false)
  } catch (e) {
    check('run: a failing command throws', e instanceof CommandExitError && e.exitCode === 4, String(e))
  }
  check('run: default user', (await s.commands.run('whoami')).stdout === 'user\n')
  await s.files.write('/home/user/n.txt', 'from npm')
  check('files: write and read', (await s.files.read('/home/user/n.txt')) === 'from npm')
  const names = (await s.files.list('/home/user')).map((e) => e.name)
  check('files: list', names.includes('n.txt'), JSON.stringify(names))
  check('files: exists', (await s.files.exists('/home/user/n.txt')) && !(await s.files.exists('/home/user/no')))
  const info = await s.getInfo()
  check('getInfo: metadata', info.metadata.suite === 'npm', JSON.stringify(info))
  const page = await Sandbox.list({ query: { metadata: { suite: 'npm' } } }).nextItems()
  check('list by metadata', page.length === 1 && page[0].sandboxId === s.sandboxId, JSON.stringify(page))
  await s.setTimeout(300_000)
  check('setTimeout', true)
} finally {
  await s.kill()
}
const after = await Sandbox.list().nextItems()
check('kill', after.every((i) => i.sandboxId !== s.sandboxId))
console.log('all passed')
