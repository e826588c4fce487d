# Shared by run.sh, test.sh and bench/run.sh: install what sbx needs on Debian/Ubuntu, as root.
# Uses the machine's own apt and cargo configuration; names no host.

need_root() {
  if [ "$(id -u)" != 0 ]; then
    echo "sbx: run this as root (sandboxes need namespaces, cgroups and mounts)" >&2
    exit 1
  fi
}

# apt packages, installed only when missing (apt-get update once, only then).
install_packages() {
  local missing=()
  for p in "$@"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "sbx: installing ${missing[*]}" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
  fi
}

need_cargo() {
  if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  fi
  if ! command -v cargo >/dev/null 2>&1; then
    install_packages cargo rustc
  fi
  local v
  v=$(rustc --version | awk '{print $2}')
  if [ "$(printf '%s\n1.89.0\n' "$v" | sort -V | head -n1)" != "1.89.0" ]; then
    echo "sbx: Rust $v is too old; sbx needs 1.89 or newer (rustup, or a newer distribution's rustc)" >&2
    exit 1
  fi
}

# Release builds of the given binaries (cargo's --bin names).
# The sandbox agent is linked statically (static-pie, glibc's libc.a):
# it is executed twice for every sandbox (`sbx-agent init` by the node, then inside as PID 1),
# and a dynamic one pays the loader and its relocations each time (~0.3 ms; docs/throughput.md).
# Only the agent's own crate gets the flag (`cargo rustc`), its dependencies are the other
# binaries'; every script builds it this way, so that no build relinks it dynamically.
build_release() {
  local bins=() agent=0 b
  for b in "$@"; do
    if [ "$b" = sbx-agent ]; then agent=1; else bins+=(--bin "$b"); fi
  done
  if [ ${#bins[@]} -gt 0 ]; then
    cargo build --release --quiet "${bins[@]}"
  fi
  if [ $agent = 1 ]; then
    cargo rustc --release --quiet -p sbx-agent --bin sbx-agent -- -C target-feature=+crt-static
  fi
}

# cargo-nextest, which test.sh runs the tests with: installed by cargo (built once, into
# cargo's bin directory) when missing or older than .config/nextest.toml asks.
need_nextest() {
  local want=0.9.91 v
  v=$(cargo nextest --version 2>/dev/null | awk 'NR==1 {print $2}')
  if [ -z "$v" ] || [ "$(printf '%s\n%s\n' "$v" "$want" | sort -V | head -n1)" != "$want" ]; then
    echo "sbx: installing cargo-nextest (the tests run with it; built once, a few minutes)" >&2
    cargo install cargo-nextest --locked >&2
  fi
}

# The packages every sbx node needs: debootstrap builds the base image; gcc links; btrfs-progs
# makes the node's disk (mkfs.btrfs, once).
install_node_packages() {
  install_packages debootstrap gcc libc6-dev ca-certificates btrfs-progs
}

# Ends the nodes a bench started (their pids, then their data directories after `--`): stops
# them, then unmounts whatever is still mounted under the directories (a node stopped before it
# had started, e.g. while it built an image, leaves its disk mounted) and removes them.
stop_nodes() {
  local pids=() dirs=() d m
  while [ $# -gt 0 ] && [ "$1" != -- ]; do pids+=("$1"); shift; done
  [ "${1:-}" = -- ] && shift
  dirs=("$@")
  if [ ${#pids[@]} -gt 0 ]; then
    kill "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
  fi
  for d in "${dirs[@]}"; do
    for m in $(awk -v d="$d/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r); do
      umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
    done
    rm -rf "$d"
  done
}

# Waits (up to 10 s) until a node answers /healthz on 127.0.0.1:PORT.
wait_healthy() {
  for _ in $(seq 1 200); do
    curl -sf "http://127.0.0.1:$1/healthz" >/dev/null 2>&1 && return 0
    sleep 0.05
  done
  echo "sbx: no node answers on port $1" >&2
  return 1
}
