// E2B's npm SDK (e2b, pinned by scripts/e2b-sdks.sh) against an sbx node, unchanged: the SDK's
// own documented examples of pause and resume (`betaPause`, `pause`, `pause({keepMemory:
// false})`, `connect`), snapshots (`createSnapshot`, `Sandbox.create(snapshotId)`,
// `listSnapshots`, `deleteSnapshot`) and forks (`fork({count})`), each checked by what it
// leaves: a file and a process survive a pause, a filesystem-only pause keeps the file and not
// the process, a snapshot's file and process are in a sandbox made from it, a fork has its
// parent's. Run by crates/sandboxd/tests/it/e2b.rs; exits non-zero at the first check that fails.
import { Sandbox } from 'e2b'

function check(what, cond, detail = '') {
  if (!cond) {
    console.log(`FAILED: ${what} ${detail}`)
    process.exit(1)
  }
  console.log(`ok: ${what}`)
}

const sleepers = async (s) =>
  (await s.commands.run('pgrep -x sleep || true')).stdout.split('\n').filter((l) => l !== '')

const made = []
const snapshots = []
try {
  // Pause and connect (the SDK's example: `await sandbox.betaPause()`, then
  // `await sandbox.connect()`).
  const s = await Sandbox.create({ timeoutMs: 120_000 })
  made.push(s)
  await s.files.write('/home/user/state.json', '{"step": 1}')
  await s.commands.run('sleep 1000', { background: true })
  check('a process runs', (await sleepers(s)).length === 1)
  check('betaPause', (await s.betaPause()) === true)
  check('paused: isRunning() is false', (await s.isRunning()) === false)
  check('paused: its state', (await s.getInfo()).state === 'paused')
  const same = await s.connect()
  check('connect resumes it', same.sandboxId === s.sandboxId && (await same.isRunning()))
  check('a file survives the pause', (await same.files.read('/home/user/state.json')) === '{"step": 1}')
  check('a process survives the pause', (await sleepers(same)).length === 1)
  check('pause', (await Sandbox.pause(s.sandboxId)) === true)
  const again = await Sandbox.connect(s.sandboxId)
  check('Sandbox.connect resumes it', await again.isRunning())
  check('its process still runs', (await sleepers(again)).length === 1)

  // A filesystem-only pause (`pause({ keepMemory: false })`): resuming boots it again.
  check('pause keepMemory: false', (await s.pause({ keepMemory: false })) === true)
  check('fs-only paused: its state', (await s.getInfo()).state === 'paused')
  const rebooted = await s.connect()
  check('fs-only: connect resumes it', await rebooted.isRunning())
  check('fs-only: its file is kept', (await rebooted.files.read('/home/user/state.json')) === '{"step": 1}')
  check('fs-only: its processes are gone', (await sleepers(rebooted)).length === 0)

  // Snapshots (the SDK's example: createSnapshot({name}), then Sandbox.create(snapshotId)).
  // A snapshot waits for the streams open on the sandbox: the command's output is let go of
  // (it runs on).
  const bg = await s.commands.run('sleep 2000', { background: true })
  await bg.disconnect()
  const name = `npm-snap-${process.pid}`
  const snap = await s.createSnapshot({ name })
  snapshots.push(snap.snapshotId)
  check('createSnapshot', typeof snap.snapshotId === 'string' && snap.snapshotId !== '', JSON.stringify(snap))
  check('the sandbox runs on', await s.isRunning())
  await s.files.write('/home/user/state.json', '{"step": 2}')
  const listed = await s.listSnapshots().nextItems()
  check('listSnapshots', listed.some((x) => x.snapshotId === snap.snapshotId), JSON.stringify(listed))
  const fromSnap = await Sandbox.create(snap.snapshotId, { timeoutMs: 60_000 })
  made.push(fromSnap)
  check('a sandbox from the snapshot', fromSnap.sandboxId !== s.sandboxId && (await fromSnap.isRunning()))
  check('the snapshot\'s file is in it', (await fromSnap.files.read('/home/user/state.json')) === '{"step": 1}')
  check('the snapshot\'s process runs in it', (await sleepers(fromSnap)).length === 1)
  await fromSnap.kill()
  await Sandbox.deleteSnapshot(snap.snapshotId)
  snapshots.pop()
  const left = await Sandbox.listSnapshots({ sandboxId: s.sandboxId }).nextItems()
  check('deleteSnapshot', !left.some((x) => x.snapshotId === snap.snapshotId), JSON.stringify(left))

  // Forks (the SDK's example: `const [fork1, fork2] = await sandbox.fork({ count: 2 })`).
  const forks = await s.fork({ count: 2, timeoutMs: 60_000 })
  for (const f of forks) if (f instanceof Sandbox) made.push(f)
  check('fork: two sandboxes', forks.length === 2 && forks.every((f) => f instanceof Sandbox), String(forks))
  for (const f of forks) {
    check('fork: its parent\'s file', (await f.files.read('/home/user/state.json')) === '{"step": 2}')
    check('fork: its parent\'s process', (await sleepers(f)).length === 1)
    check('fork: runs commands', (await f.commands.run('echo "hello from fork"')).stdout === 'hello from fork\n')
  }
  check('fork: the parent runs on', await s.isRunning())
} finally {
  for (const id of snapshots) {
    try {
      await Sandbox.deleteSnapshot(id)
    } catch (e) {}
  }
  for (const x of made) {
    try {
      await x.kill()
    } catch (e) {}
  }
}
console.log('all passed')
