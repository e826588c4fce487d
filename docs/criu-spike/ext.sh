# the mounts that come from the host (binds): external to criu, by their mountpoint in the sandbox
EXT_MOUNTS="$EXTRA_MOUNTS /dev/null /dev/zero /dev/full /dev/random /dev/urandom /dev/tty /proc/keys /proc/timer_list /etc/ssl/certs/ca-certificates.crt /.sbx"
key() { echo "m$(echo $1 | tr '/.' '__')"; }
ext_dump() { for m in $EXT_MOUNTS; do printf -- "--external mnt[%s]:%s " $m $(key $m); done; }
# on restore the key maps to the host path the bind comes from
ext_restore() { for m in $EXT_MOUNTS; do src=$m; case $m in /proc/*) src=/dev/null;; /.sbx) src=/work/e2bsdk/criu;; /.sbxbin) src=/tmp/criu-bin-py;; esac; printf -- "--external mnt[%s]:%s " $(key $m) $src; done; }
