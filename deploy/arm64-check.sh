#!/usr/bin/env bash
# One command: an x86 coordinator, one x86 agent and one aarch64 agent (an arm64
# Debian 12 root under qemu-user-static) train the digits job over a Mosquitto on
# 127.0.0.1; then the same job on two x86 agents, for comparison. Slow (emulation):
# not part of the test suite. Run as root from the repository root after `make setup`:
#
#   deploy/arm64-check.sh                 # ROUNDS=200 RESYNC_EVERY=50 by default
#   ROUNDS=100 deploy/arm64-check.sh      # shorter
#   JOB_EXTRA='compression = "none"' deploy/arm64-check.sh   # more job fields
#
# It installs the agent inside the root as docs/deploy.md says for Raspberry Pi OS
# (torch 2.9.1 from PyPI, a CPU build on aarch64; fedring with the `digits` extra),
# and prints each run's summary figures: accuracy, members and re-formations,
# machines, and the measured cross-architecture drift. Work files: $ROOT, $WORK.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
ROOT=${ROOT:-/var/tmp/fedring-arm64/root}
WORK=${WORK:-/var/tmp/fedring-arm64/work}
ROUNDS=${ROUNDS:-200}
RESYNC_EVERY=${RESYNC_EVERY:-50}
PORT=${PORT:-18830}
TORCH_ARM64=${TORCH_ARM64:-2.9.1}
PY=$REPO/.venv/bin/python
mkdir -p "$WORK"
[ -x "$PY" ] || { echo "run 'make setup' first" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "run as root (debootstrap, chroot, binfmt)" >&2; exit 2; }

step() { echo "== $(date -u +%H:%M:%S) $*"; }

# 1. qemu-user-static and its binfmt handler (F flag: usable inside the chroot).
if ! command -v debootstrap >/dev/null || [ ! -x /usr/bin/qemu-aarch64-static ]; then
    step "installing debootstrap qemu-user-static binfmt-support"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap qemu-user-static binfmt-support
fi
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
update-binfmts --enable qemu-aarch64 2>/dev/null || true
grep -q enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 || {
    echo "binfmt_misc refused qemu-aarch64: this kernel cannot run arm64 binaries" >&2; exit 1; }

# 2. An arm64 bookworm root (the base of 64-bit Raspberry Pi OS).
if [ ! -x "$ROOT/usr/bin/python3" ]; then
    step "debootstrap arm64 bookworm into $ROOT (about 10 min under qemu)"
    mkdir -p "$ROOT"
    debootstrap --arch=arm64 --variant=minbase \
        --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$ROOT" http://deb.debian.org/debian
fi
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
# A host that reaches PyPI through a TLS-inspecting proxy trusts its CA: so must the root.
cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
trap 'cleanup' EXIT
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    umount "$ROOT/proc" 2>/dev/null || true
}
inroot() { chroot "$ROOT" /usr/bin/env -u PIP_FIND_LINKS -u PIP_CONSTRAINT HOME=/root "$@"; }

# 3. The agent, installed as docs/deploy.md says for Raspberry Pi OS.
step "installing the agent in the arm64 root"
rm -rf "$ROOT/opt/fedring/src" && mkdir -p "$ROOT/opt/fedring/src"
git ls-files -z | xargs -0 tar -cf - | tar -xf - -C "$ROOT/opt/fedring/src"
inroot /bin/sh -ec "
    cd /opt/fedring
    [ -x .venv/bin/pip ] || python3 -m venv .venv
    .venv/bin/pip install --quiet --progress-bar off torch==$TORCH_ARM64
    .venv/bin/pip install --quiet --progress-bar off -c src/constraints-arm64.txt -e 'src[digits]'
    .venv/bin/python -c 'import platform, torch; print(platform.machine(), torch.__version__)'
"
du -sm "$ROOT/opt/fedring/.venv" | awk '{print "arm64 agent venv: " $1 " MB"}'

# 4. A broker on loopback, the agents, the coordinator.
cat > "$WORK/mosquitto.conf" <<EOF
listener $PORT 127.0.0.1
allow_anonymous true
set_tcp_nodelay true
max_queued_messages 10000
EOF
/usr/sbin/mosquitto -c "$WORK/mosquitto.conf" > "$WORK/mosquitto.log" 2>&1 &
PIDS+=($!)
URL=mqtt://127.0.0.1:$PORT
cat > "$WORK/job.toml" <<EOF
[job]
agents = 2
dataset = "digits"
rounds = $ROUNDS
eval_every = 10
seed = 0
timeout_s = 300.0
resync_every = $RESYNC_EVERY
${JOB_EXTRA:-}
EOF

run_job() {  # NAME: coordinator run of job.toml; prints the figures
    local name=$1
    rm -rf "$WORK/$name"
    step "coordinator: $name"
    "$PY" -m fedring coordinator run "$WORK/job.toml" --broker "$URL" --out "$WORK/$name" \
        --enrol-timeout 900 --json > "$WORK/$name.json" 2> "$WORK/$name-coordinator.log"
    "$PY" - "$WORK/$name.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
print(json.dumps({k: s.get(k) for k in (
    "final_accuracy", "rounds", "members", "epochs", "reformations", "events", "machines",
    "identical_models", "model_hashes", "drift", "wall_seconds")}, indent=1))
print("hash_mismatch:", s["coordinator_counters"].get("hash_mismatch", 0))
EOF
}

agent_x86() { "$PY" -m fedring -v agent --broker "$URL" --id "$1" > "$WORK/$1.log" 2>&1 & PIDS+=($!); }
agent_arm() {  # exec: $! is the agent itself (qemu running python), stopped by PID
    (exec chroot "$ROOT" /usr/bin/env HOME=/root /opt/fedring/.venv/bin/python -m fedring -v \
        agent --broker "$URL" --id "$1" > "$WORK/$1.log" 2>&1) &
    PIDS+=($!)
}
stop_last_two() {  # SIGTERM: the agents halt, publish "offline" and exit
    local a=${PIDS[-1]} b=${PIDS[-2]}
    kill "$a" "$b" 2>/dev/null || true
    wait "$a" "$b" 2>/dev/null || true
}

agent_x86 x86-a
agent_arm arm-a
run_job mixed
stop_last_two
agent_x86 x86-b
agent_x86 x86-c
run_job x86
stop_last_two
step "done: $WORK/mixed.json, $WORK/x86.json"
