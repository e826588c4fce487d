#!/usr/bin/env bash
# Benchmark of OCI images through a node: a docker-registry on loopback and a sandboxd of the
# bench's own (temporary data and images directories, the machine's base image), a large image
# written and pushed by the bench (the base rootfs as a layer + 100 MiB of random bytes), then
# POST /v1/sandboxes until running when the image must be pulled (a fresh image each time) and
# when the node has it, and POST /v1/run of echo in it. As root. Prints a table.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
need_root
install_node_packages
install_packages docker-registry
need_cargo
build_release sandboxd sbx-agent sbx-bench-images
images="${SBX_IMAGES_DIR:-/var/lib/sbx/images}"
target/release/sandboxd --images-dir "$images" build-base >&2
target/release/sbx-bench-images --sandboxd target/release/sandboxd --images-dir "$images" "$@"
