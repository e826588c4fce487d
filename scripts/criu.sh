#!/bin/sh
# Installs CRIU >= 4.2 (the node's sleep, snapshots and forks checkpoint sandboxes with it), as
# root; idempotent. In order: a criu >= 4.2 already first in PATH or at $WRAPPER is kept; one
# the machine's own apt sources offer is installed with apt; on Debian 12 (whose 3.17 fails on
# recent kernels) criu is taken from Debian's `unstable` suite as below. Exits non-zero when
# none of these works (a node then runs without CRIU: it says so in GET /internal/node and
# answers sleep and snapshot calls 503 not_served_here).
#
# Debian 12:
# Why not `apt-get install criu/unstable` with a pin: criu 4.2.1-1 in unstable depends on
# libc6 (>= 2.38), libgnutls30t64, libnl-3-200 (>= 3.11) and a libcompel1 of its own; on
# bookworm (libc6 2.36) apt can only satisfy that by taking libc6/libc-bin/base-files from
# unstable, which REMOVES build-essential, gcc/g++, libc6-dev, postgresql, valgrind and ~45
# other packages (tried with `apt-get install -s`). A pin that lets only criu through therefore
# cannot work on bookworm. Instead this script:
#   1. derives the Debian mirror from the machine's own apt sources (no host name is written here),
#   2. reads unstable's package index with a PRIVATE apt state (the system's sources, preferences
#      and lists are not touched),
#   3. downloads criu and the libraries it links (with unstable's own libc) and unpacks them under
#      $PREFIX (default /opt/sbx-criu), never through dpkg,
#   4. installs /usr/local/sbin/criu, a wrapper that runs that criu with its own dynamic loader
#      and library path (children criu execs, e.g. ip/nft, get the system's libc as usual).
# Debian 12's own criu 3.17 does not work on this kernel (vdso: Failed to fill self vdso
# symtable); it may stay installed, /usr/local/sbin comes first in PATH.
set -eu

PREFIX=${PREFIX:-/opt/sbx-criu}
WRAPPER=${WRAPPER:-/usr/local/sbin/criu}
STATE=${STATE:-/var/cache/sbx-criu-apt}
MIN_MAJOR=4 MIN_MINOR=2

version_ok() {
    v=$("$1" --version 2>/dev/null | sed -n 's/^Version: *//p')
    [ -n "$v" ] || return 1
    maj=${v%%.*}; rest=${v#*.}; min=${rest%%.*}
    [ "$maj" -gt "$MIN_MAJOR" ] || { [ "$maj" -eq "$MIN_MAJOR" ] && [ "$min" -ge "$MIN_MINOR" ]; }
}

if [ -x "$WRAPPER" ] && version_ok "$WRAPPER"; then
    echo "sbx: criu $("$WRAPPER" --version | sed -n 's/^Version: *//p') is installed ($WRAPPER)" >&2
    exit 0
fi
if command -v criu >/dev/null 2>&1 && version_ok "$(command -v criu)"; then
    echo "sbx: criu $(criu --version | sed -n 's/^Version: *//p') is installed ($(command -v criu))" >&2
    exit 0
fi
# The machine's own sources, where they have 4.2 or newer (Debian 13's backports, Ubuntu's
# later releases).
candidate=$(apt-cache policy criu 2>/dev/null | sed -n 's/^ *Candidate: *//p')
case "$candidate" in
    ""|"(none)") ;;
    *)
        if dpkg --compare-versions "$candidate" ge 4.2; then
            echo "sbx: installing criu $candidate" >&2
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq criu >&2
            version_ok "$(command -v criu)" && exit 0
        fi
        ;;
esac
if ! grep -q '^ID=debian' /etc/os-release 2>/dev/null; then
    echo "sbx: no criu >= 4.2 for this system: sleep, snapshots and forks are off" >&2
    exit 1
fi
echo "sbx: installing criu from Debian's unstable suite into $PREFIX" >&2

# 1. The mirror: the first URI of a deb822 stanza whose suites are Debian's main archive (not
#    -security), else the first such line of /etc/apt/sources.list.
mirror=""
for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    mirror=$(awk '
        BEGIN { RS = ""; FS = "\n" }
        {
            uri = ""; suites = ""; enabled = 1
            for (i = 1; i <= NF; i++) {
                if ($i ~ /^URIs:/)    { uri = $i; sub(/^URIs:[ \t]*/, "", uri); split(uri, u, /[ \t]+/); uri = u[1] }
                if ($i ~ /^Suites:/)  { suites = $i }
                if ($i ~ /^Enabled:[ \t]*no/) { enabled = 0 }
            }
            if (enabled && uri != "" && suites !~ /-security/ && suites ~ /(bookworm|trixie|forky|stable|testing|sid|unstable)/) { print uri; exit }
        }' "$f")
    [ -n "$mirror" ] && break
done
if [ -z "$mirror" ] && [ -f /etc/apt/sources.list ]; then
    mirror=$(awk '$1 == "deb" && $0 !~ /security/ { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z+]+:\/\//) { print $i; exit } }' /etc/apt/sources.list)
fi
[ -n "$mirror" ] || { echo "criu.sh: no Debian mirror found in the apt sources" >&2; exit 1; }
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
echo "sbx: criu: mirror $mirror" >&2

# 2. A private apt state with unstable only.
mkdir -p "$STATE/lists/partial" "$STATE/archives/partial" "$STATE/etc/preferences.d" "$STATE/debs"
cat > "$STATE/etc/unstable.sources" <<SRC
Types: deb
URIs: $mirror
Suites: unstable
Components: main
Signed-By: $keyring
SRC
APT="-o Dir::Etc::sourcelist=$STATE/etc/unstable.sources -o Dir::Etc::sourceparts=- \
 -o Dir::Etc::preferencesparts=$STATE/etc/preferences.d -o Dir::State::lists=$STATE/lists \
 -o Dir::Cache::archives=$STATE/archives -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache= \
 -o APT::Default-Release=unstable -o Debug::NoLocking=1"
# shellcheck disable=SC2086
apt-get $APT update -qq

# 3. criu and what it links, from unstable (the list is criu's shared-library closure as of
#    4.2.1-1; ldd below fails loudly if a new dependency appears).
PKGS="criu libc6 libbsd0 libmd0 libgnutls30t64 libnettle8t64 libhogweed6t64 libgmp10 libidn2-0
      libunistring5 libtasn1-6 libp11-kit0 libffi8 libnftables1 libnftnl11 libmnl0 libjansson4
      libxtables12 libprotobuf-c1 libnl-3-200 libnet9 libuuid1 libedit2"
cd "$STATE/debs"
rm -f ./*.deb
# shellcheck disable=SC2086
apt-get $APT download $(for p in $PKGS; do printf '%s/unstable ' "$p"; done) 2>&1 | grep -v '^W: Download is performed unsandboxed' || true
rm -rf "$PREFIX.new"; mkdir -p "$PREFIX.new"
for d in ./*.deb; do dpkg-deb -x "$d" "$PREFIX.new"; done
LIBDIR=$PREFIX/usr/lib/x86_64-linux-gnu
LD=$LIBDIR/ld-linux-x86-64.so.2
if "$PREFIX.new/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --library-path "$PREFIX.new/usr/lib/x86_64-linux-gnu" \
        --list "$PREFIX.new/usr/sbin/criu" | grep -q 'not found'; then
    echo "criu.sh: criu needs a library not in PKGS:" >&2
    "$PREFIX.new/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --library-path "$PREFIX.new/usr/lib/x86_64-linux-gnu" \
        --list "$PREFIX.new/usr/sbin/criu" | grep 'not found' >&2
    exit 1
fi
rm -rf "$PREFIX.old"; [ -d "$PREFIX" ] && mv "$PREFIX" "$PREFIX.old"
mv "$PREFIX.new" "$PREFIX"; rm -rf "$PREFIX.old"

# 4. The wrapper.
mkdir -p "$(dirname "$WRAPPER")"
cat > "$WRAPPER.tmp" <<EOF
#!/bin/sh
# criu from Debian unstable with its own libc, kept apart from the system (scripts/criu.sh)
exec $LD --library-path $LIBDIR $PREFIX/usr/sbin/criu "\$@"
EOF
chmod 755 "$WRAPPER.tmp"; mv "$WRAPPER.tmp" "$WRAPPER"

"$WRAPPER" --version >&2
version_ok "$WRAPPER" || { echo "criu.sh: criu is older than $MIN_MAJOR.$MIN_MINOR" >&2; exit 1; }
"$WRAPPER" check >&2 || echo "criu.sh: criu check reported missing features (see above)" >&2
