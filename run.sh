#!/usr/bin/env bash
# ./run.sh demo | test | bench | setup | env
#
#   demo   set up, then train the digits demo (examples/train_digits.py)
#   test   set up, then run the test suite on every core (what CI runs); ./run.sh test ARGS runs pytest ARGS
#   bench  set up, then run the CPU benchmarks (bench/run.py)
#   setup  set up only (test and demo extras)
#   env    print where things would be installed and which torch, and change nothing
#
# Where things get installed (the README's set-up paragraph says the same):
#   * An active virtual environment is used as it is: $VIRTUAL_ENV, or $PYTHON (default python3) being
#     a virtual environment's interpreter (sys.prefix != sys.base_prefix).
#   * Otherwise everything goes into .venv/ in this checkout, made on the first run and reused after.
#     Nothing is ever pip-installed into an interpreter that is not a virtual environment: not a PEP 668
#     "externally managed" system Python, and not a plain pyenv, conda or Docker-image Python either,
#     which other projects share. Making .venv costs seconds.
#   * .venv sees the base interpreter's packages (--system-site-packages; pip still writes only into
#     .venv) when, and only when, that interpreter is not externally managed and already has a torch that
#     suits this machine (2.11 <= torch < 3, a CUDA build where an NVIDIA GPU is present): that torch is
#     reused instead of downloaded again. An externally managed interpreter's packages belong to the
#     system's package manager, so its .venv is always isolated.
#
# torch, when the environment has none (or one outside >=2.11,<3):
#   * an NVIDIA GPU is present (nvidia-smi lists one, or /proc/driver/nvidia/gpus does): the CUDA build,
#     torch==$TORCH_PIN from PyPI (PyPI's Linux x86_64 wheel is the CUDA one);
#   * no NVIDIA GPU: the CPU build, from PyTorch's CPU wheel index first (15 s timeout, no retries: it may
#     be unreachable), then torch==$TORCH_PIN from PyPI, which pip serves as the CPU build where it has one
#     at hand (a local wheel directory or cache), and otherwise as PyPI's own wheel: on Linux x86_64 that
#     is the large CUDA build, which runs on the CPU as well (run.sh says so when it happens).
#   AUTOCASTFX_TORCH overrides the choice: "cpu", "cuda", or pip arguments ("torch==2.11.0", a wheel's
#   path, "--index-url https://download.pytorch.org/whl/cu126 torch"); "cpu"/"cuda" also replace an
#   installed torch of the other build. Everything else comes from pyproject.toml's extras.
set -euo pipefail
cd "$(dirname "$0")"

TORCH_PIN=2.13.0
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
VENV="$PWD/.venv"

say() { echo "run.sh: $*" >&2; }
die() { echo "run.sh: error: $*" >&2; exit 1; }

# probe PYTHON [--torch]: facts about an interpreter, as P_* shell variables. Importing torch takes a
# second or two, so only the callers that need it ask for it.
probe() {
  local py="$1" facts key value
  shift
  P_executable="" P_version="" P_prefix="" P_venv="" P_managed="" P_venv_module="" P_virtualenv=""
  P_torch="" P_torch_cuda=""
  facts=$("$py" - "$@" <<'PY'
import importlib.util, os, sys, sysconfig

def fact(key, value):
    print("%s=%s" % (key, str(value).replace("\n", " ")))

def has(module):
    try:
        return importlib.util.find_spec(module) is not None
    except Exception:
        return False

fact("executable", sys.executable)
fact("version", "%d.%d.%d" % sys.version_info[:3])
fact("prefix", sys.prefix)
fact("venv", "yes" if sys.prefix != sys.base_prefix else "no")
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")  # PEP 668
fact("managed", "yes" if os.path.isfile(marker) else "no")
fact("venv_module", "yes" if has("venv") and has("ensurepip") else "no")
fact("virtualenv", "yes" if has("virtualenv") else "no")
if "--torch" in sys.argv:
    import contextlib, io, warnings
    warnings.simplefilter("ignore")
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            import torch
        fact("torch", torch.__version__)
        fact("torch_cuda", torch.version.cuda or "")
    except ModuleNotFoundError as e:
        fact("torch", "none" if e.name == "torch" else "broken: %s" % e)
    except Exception as e:
        fact("torch", "broken: %s: %s" % (type(e).__name__, e))
PY
) || die "'$py' did not run; set PYTHON=/path/to/python3 (3.10 or newer)"
  while IFS='=' read -r key value; do
    case "$key" in
      executable|version|prefix|venv|managed|venv_module|virtualenv|torch|torch_cuda)
        printf -v "P_$key" '%s' "$value" ;;
    esac
  done <<<"$facts"
}

# nvidia_gpu: an NVIDIA GPU with a loaded driver: nvidia-smi lists one, or the kernel driver does.
nvidia_gpu() {
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    return 0
  fi
  [ -n "$(ls -A /proc/driver/nvidia/gpus 2>/dev/null)" ]
}

# torch_fits VERSION CUDA BUILD: is a torch of this version (and CUDA version, empty for none) inside
# >=2.11,<3 and of BUILD: "cpu" (no CUDA), "cuda" (with CUDA) or "any"? ("none": never.)
torch_fits() {
  local version="$1" cuda="$2" build="$3" major minor
  case "$version" in ""|none|broken*) return 1 ;; esac
  major=${version%%.*}
  minor=${version#*.}
  minor=${minor%%.*}
  [ "$major" = 2 ] && [ "$minor" -ge 11 ] 2>/dev/null || return 1
  case "$build" in
    cpu) [ -z "$cuda" ] ;;
    cuda) [ -n "$cuda" ] ;;
    any) return 0 ;;
    *) return 1 ;;
  esac
}

# describe_torch VERSION CUDA: "2.13.0+cpu (CPU build)" or "2.11.0+cu130 (CUDA 13.0 build)"
describe_torch() {
  if [ -n "$2" ]; then echo "$1 (CUDA $2 build)"; else echo "$1 (CPU build)"; fi
}

# choose_torch_build: sets GPU (yes | no), TORCH_WANT (cpu | cuda | pip) and TORCH_BUILD, the build a
# base interpreter's torch must be for a new .venv to reuse it (cpu | cuda | any | none). With a GPU only
# a CUDA build is reused; AUTOCASTFX_TORCH's pip arguments always get an isolated .venv.
choose_torch_build() {
  if nvidia_gpu; then GPU=yes; else GPU=no; fi
  case "${AUTOCASTFX_TORCH:-}" in
    "") if [ "$GPU" = yes ]; then TORCH_WANT=cuda TORCH_BUILD=cuda; else TORCH_WANT=cpu TORCH_BUILD=any; fi ;;
    cpu|cuda) TORCH_WANT="$AUTOCASTFX_TORCH" TORCH_BUILD="$AUTOCASTFX_TORCH" ;;
    *) TORCH_WANT=pip TORCH_BUILD=none ;;
  esac
}

# choose_environment: sets BASE_PY, BASE_EXE, BASE_VERSION, BASE_KIND (venv | externally-managed | plain),
# ENV_DIR, ENV_PY, ENV_ACTION (use-active | reuse | create | recreate), SYSTEM_SITE (yes | no | as-is),
# BASE_TORCH, BASE_TORCH_CUDA and ENV_WHY.
choose_environment() {
  local cand="${PYTHON:-}"
  if [ -z "$cand" ] && [ -n "${VIRTUAL_ENV:-}" ]; then
    cand="$VIRTUAL_ENV/bin/python"
    [ -x "$cand" ] || die "VIRTUAL_ENV=$VIRTUAL_ENV has no bin/python: run 'deactivate' (or re-create that environment) and run again"
  fi
  cand="${cand:-python3}"
  command -v "$cand" >/dev/null 2>&1 \
    || die "no '$cand' found: install Python 3.10 or newer (Debian/Ubuntu: apt-get install python3 python3-venv) or set PYTHON=/path/to/python3"
  probe "$cand"
  case "$P_version" in
    3.[0-9].*|2.*) die "$cand is Python $P_version; autocastfx needs 3.10 or newer: set PYTHON=/path/to/python3.10+" ;;
  esac
  BASE_PY="$cand" BASE_EXE="$P_executable" BASE_VERSION="$P_version" BASE_TORCH="" BASE_TORCH_CUDA=""
  if [ "$P_venv" = yes ]; then
    BASE_KIND=venv ENV_DIR="$P_prefix" ENV_PY="$cand" ENV_ACTION=use-active SYSTEM_SITE=as-is
    ENV_WHY="the active virtual environment"
    return
  fi
  if [ "$P_managed" = yes ]; then BASE_KIND=externally-managed; else BASE_KIND=plain; fi
  local base_venv_module="$P_venv_module" base_virtualenv="$P_virtualenv" base_managed="$P_managed"
  ENV_DIR="$VENV" ENV_PY="$VENV/bin/python"
  if [ -e "$VENV" ]; then
    if [ -x "$ENV_PY" ] && "$ENV_PY" -c "" >/dev/null 2>&1; then
      ENV_ACTION=reuse SYSTEM_SITE=as-is ENV_WHY="this checkout's .venv, made on an earlier run"
      return
    fi
    [ -f "$VENV/pyvenv.cfg" ] || die "$VENV exists but is no virtual environment: move it away and run again"
    ENV_ACTION=recreate
  else
    ENV_ACTION=create
  fi
  if [ "$base_venv_module" != yes ] && [ "$base_virtualenv" != yes ]; then
    die "$cand cannot make a virtual environment (no venv/ensurepip module), and run.sh never installs into a Python that is not one: install it (Debian/Ubuntu: apt-get install python3-venv), or activate any virtual environment first, or set PYTHON= to another Python 3.10+"
  fi
  if [ "$base_managed" = yes ]; then
    SYSTEM_SITE=no
    ENV_WHY="$cand is externally managed (PEP 668): never installed into, and its packages are not shared"
    return
  fi
  probe "$cand" --torch
  BASE_TORCH="$P_torch" BASE_TORCH_CUDA="$P_torch_cuda"
  if torch_fits "$BASE_TORCH" "$BASE_TORCH_CUDA" "$TORCH_BUILD"; then
    SYSTEM_SITE=yes
    ENV_WHY="$cand is not a virtual environment, so it is not installed into; its torch $(describe_torch "$BASE_TORCH" "$BASE_TORCH_CUDA") suits this machine and is reused"
  else
    SYSTEM_SITE=no
    local why
    if [ "$BASE_TORCH" = none ]; then why="it has no torch"
    elif [ "$TORCH_BUILD" = none ]; then why="AUTOCASTFX_TORCH names the torch to install"
    elif ! torch_fits "$BASE_TORCH" "$BASE_TORCH_CUDA" any; then why="its torch $BASE_TORCH is outside >=2.11,<3"
    elif [ "$TORCH_BUILD" = cpu ]; then why="its torch $(describe_torch "$BASE_TORCH" "$BASE_TORCH_CUDA") is not the CPU build asked for"
    else why="its torch $(describe_torch "$BASE_TORCH" "$BASE_TORCH_CUDA") is not the CUDA build wanted here"; fi
    ENV_WHY="$cand is not a virtual environment, so it is not installed into; $why, so .venv is isolated"
  fi
}

# choose_torch_action: sets ENV_TORCH, ENV_TORCH_CUDA (what the environment has or will have before any
# torch install), TORCH_ACTION (keep | install | replace), TORCH_WHY and TORCH_WARN.
choose_torch_action() {
  TORCH_WARN=""
  case "$ENV_ACTION" in
    use-active|reuse) probe "$ENV_PY" --torch; ENV_TORCH="$P_torch" ENV_TORCH_CUDA="$P_torch_cuda" ;;
    *) if [ "$SYSTEM_SITE" = yes ]; then ENV_TORCH="$BASE_TORCH" ENV_TORCH_CUDA="$BASE_TORCH_CUDA"
       else ENV_TORCH=none ENV_TORCH_CUDA=""; fi ;;
  esac
  case "$ENV_TORCH" in
    broken*) die "torch in $ENV_DIR does not import ($ENV_TORCH): reinstall it ($ENV_PY -m pip install --force-reinstall torch), or, for this checkout's .venv, remove .venv and run again" ;;
  esac
  if [ "$TORCH_WANT" = pip ]; then
    TORCH_ACTION=install TORCH_WHY="AUTOCASTFX_TORCH asks for: pip install $AUTOCASTFX_TORCH"
  elif [ "$ENV_TORCH" = none ]; then
    TORCH_ACTION=install TORCH_WHY="no torch in the environment"
  elif ! torch_fits "$ENV_TORCH" "$ENV_TORCH_CUDA" any; then
    TORCH_ACTION=install TORCH_WHY="torch $ENV_TORCH is outside >=2.11,<3"
  elif [ "$TORCH_BUILD" != any ] && [ -n "${AUTOCASTFX_TORCH:-}" ] \
       && ! torch_fits "$ENV_TORCH" "$ENV_TORCH_CUDA" "$TORCH_BUILD"; then
    TORCH_ACTION=replace TORCH_WHY="AUTOCASTFX_TORCH=$AUTOCASTFX_TORCH, and torch $(describe_torch "$ENV_TORCH" "$ENV_TORCH_CUDA") is the other build"
  else
    TORCH_ACTION=keep TORCH_WHY="torch $(describe_torch "$ENV_TORCH" "$ENV_TORCH_CUDA") is already there"
    if [ "$GPU" = yes ] && [ -z "$ENV_TORCH_CUDA" ]; then
      TORCH_WARN="an NVIDIA GPU is present but this torch cannot use it: AUTOCASTFX_TORCH=cuda ./run.sh ... replaces it"
      TORCH_WHY="$TORCH_WHY; $TORCH_WARN"
    fi
  fi
}

print_decisions() {
  echo "python=$BASE_PY"
  echo "python_executable=$BASE_EXE"
  echo "python_version=$BASE_VERSION"
  echo "python_kind=$BASE_KIND"
  echo "env=$ENV_DIR"
  echo "env_action=$ENV_ACTION"
  echo "system_site_packages=$SYSTEM_SITE"
  echo "env_why=$ENV_WHY"
  echo "nvidia_gpu=$GPU"
  echo "torch_want=$TORCH_WANT"
  echo "torch_found=$ENV_TORCH"
  echo "torch_action=$TORCH_ACTION"
  echo "torch_why=$TORCH_WHY"
}

make_environment() {
  local site_flag=()
  [ "$SYSTEM_SITE" = yes ] && site_flag=(--system-site-packages)
  case "$ENV_ACTION" in
    create|recreate)
      say "making $ENV_DIR ($ENV_WHY)"
      if "$BASE_PY" -c "import venv, ensurepip" >/dev/null 2>&1; then
        "$BASE_PY" -m venv --clear ${site_flag[@]+"${site_flag[@]}"} "$ENV_DIR"
      else
        "$BASE_PY" -m virtualenv --clear ${site_flag[@]+"${site_flag[@]}"} "$ENV_DIR"
      fi ;;
    *) say "using $ENV_DIR ($ENV_WHY)" ;;
  esac
  if ! "$ENV_PY" -c "import pip" >/dev/null 2>&1; then
    say "$ENV_DIR has no pip: adding it with ensurepip"
    "$ENV_PY" -m ensurepip --default-pip >/dev/null
  fi
}

# use_uv: whether this run installs with uv: into a .venv of run.sh's own (never an environment it was handed),
# unless AUTOCASTFX_PIP=1; pip puts uv into that .venv once. uv installs and compiles in a third of pip's time (the
# suite's set-up is on CI's clock); wherever it cannot install something, pip does.
UV=unknown
use_uv() {
  if [ "$UV" = unknown ]; then
    UV=no
    if [ "$ENV_ACTION" != use-active ] && [ "${AUTOCASTFX_PIP:-}" != 1 ] \
        && "$ENV_PY" -m pip install --quiet uv >/dev/null 2>&1; then
      UV=yes
    fi
  fi
  [ "$UV" = yes ]
}

# uv_install ARGS: uv pip install into the environment, given the wheel directories pip is configured with (pip
# config's global.find-links, PIP_FIND_LINKS), which uv does not read of itself; pip's other settings (its indexes,
# constraints) are not passed on: uv uses its own, PyPI by default. No bytecode is compiled here (a minute and a half
# of CPU for the 15,000 modules of torch and the extras): see keep_bytecode.
uv_install() {
  local links=() link
  for link in $( { "$ENV_PY" -m pip config get global.find-links 2>/dev/null || true; } ) ${PIP_FIND_LINKS:-}; do
    case "$link" in  # uv stops at a directory that is not there, where pip passes over it
      *://*) links+=(--find-links "$link") ;;
      *) [ ! -d "$link" ] || links+=(--find-links "$link") ;;
    esac
  done
  UV_HTTP_TIMEOUT=15 "$ENV_PY" -m uv pip install --quiet --python "$ENV_PY" \
    ${links[@]+"${links[@]}"} "$@"
}

# install_cpu_torch [FORCE]: the CPU build from PyTorch's CPU index, else torch==$TORCH_PIN as PyPI and the local
# wheel directories serve it; with uv first where this run uses it, then pip.
install_cpu_torch() {
  local pip=("$ENV_PY" -m pip install --quiet)
  if use_uv; then
    UV_HTTP_RETRIES=0 uv_install "$@" --index-url "$TORCH_CPU_INDEX" "torch==$TORCH_PIN" 2>/dev/null && return
    uv_install "$@" "torch==$TORCH_PIN" 2>/dev/null && return
    say "uv could not install torch; installing it with pip"
  fi
  "${pip[@]}" "$@" --index-url "$TORCH_CPU_INDEX" --timeout 15 --retries 0 "torch==$TORCH_PIN" 2>/dev/null \
    || { say "the CPU wheel index did not answer; installing torch==$TORCH_PIN from PyPI"
         "${pip[@]}" "$@" "torch==$TORCH_PIN"; }
}

install_torch() {
  local pip=("$ENV_PY" -m pip install --quiet) force=()
  [ "$TORCH_ACTION" = replace ] && force=(--force-reinstall)
  say "installing torch ($TORCH_WHY)"
  case "$TORCH_WANT" in
    cpu) install_cpu_torch ${force[@]+"${force[@]}"} ;;
    cuda)
      # Leave out a local CPU wheel of the same version that pip may have at hand.
      "${pip[@]}" ${force[@]+"${force[@]}"} "torch==$TORCH_PIN,!=$TORCH_PIN+cpu" ;;
    pip)
      local args
      set -f
      # shellcheck disable=SC2206  # pip arguments, split on white space on purpose
      args=($AUTOCASTFX_TORCH)
      set +f
      "${pip[@]}" "${args[@]}" ;;
  esac
  probe "$ENV_PY" --torch
  case "$P_torch" in
    none|broken*) die "torch did not install into $ENV_DIR ($P_torch); set AUTOCASTFX_TORCH to pip arguments that work here, e.g. a wheel's path" ;;
  esac
  say "torch $(describe_torch "$P_torch" "$P_torch_cuda") in $ENV_DIR"
  if [ "$TORCH_WANT" = cpu ] && [ -n "$P_torch_cuda" ]; then
    say "no CPU build was reachable, so this is PyPI's CUDA build: it runs on the CPU too"
  elif [ "$TORCH_WANT" = cuda ] && [ -z "$P_torch_cuda" ]; then
    say "warning: this torch has no CUDA; install a CUDA build with AUTOCASTFX_TORCH='--index-url https://download.pytorch.org/whl/cu126 torch'"
  fi
}

# install_package: the package and its extras, into the environment: with uv where this run uses it and the torch
# it imports is the environment's own, held at its version by a constraint so that uv never fetches another; else pip.
install_package() {
  local spec=".[$extras]" pin=""
  if [ "$ENV_ACTION" != use-active ] && [ "${AUTOCASTFX_PIP:-}" != 1 ]; then
    pin=$("$ENV_PY" - <<'PY' 2>/dev/null || true
import os, sys, torch
here = os.path.realpath(torch.__file__).startswith(os.path.realpath(sys.prefix) + os.sep)
print(torch.__version__ if here else "")
PY
)
  fi
  if [ -n "$pin" ] && use_uv; then
    if uv_install --constraint <(echo "torch==$pin") -e "$spec"; then
      return
    fi
    say "uv could not install the extras; installing them with pip"
  fi
  "$ENV_PY" -m pip install --quiet -e "$spec"
}

# keep_bytecode: in an isolated .venv of run.sh's own, Python writes the bytecode of each module it imports the first time
# (PYTHONDONTWRITEBYTECODE cleared for what run.sh runs): the modules the tests and the demo import are compiled once,
# by the first process that imports them, instead of all of them at install, or again in every process. An
# environment run.sh was handed keeps the caller's setting.
keep_bytecode() {
  local shared="$SYSTEM_SITE"
  if [ "$ENV_ACTION" = reuse ]; then  # this checkout's .venv from an earlier run: isolated or not, as made then
    if grep -qiE '^include-system-site-packages *= *true' "$ENV_DIR/pyvenv.cfg" 2>/dev/null; then
      shared=yes
    else
      shared=no
    fi
  fi
  # never where Python would write into another interpreter's packages (a .venv that sees the base's)
  if [ "$ENV_ACTION" != use-active ] && [ "$shared" != yes ]; then
    unset PYTHONDONTWRITEBYTECODE
  fi
}

what="${1:-demo}"
case "$what" in
  demo) extras=demo ;;
  test|bench) extras="test" ;;
  setup) extras=test,demo ;;
  env) extras="" ;;
  *) echo "usage: ./run.sh demo|test|bench|setup|env" >&2; exit 2 ;;
esac

choose_torch_build
choose_environment
choose_torch_action
if [ "$what" = env ]; then
  print_decisions
  exit 0
fi
keep_bytecode
make_environment
if [ "$TORCH_ACTION" = keep ]; then
  [ -z "$TORCH_WARN" ] || say "warning: $TORCH_WARN"
else
  install_torch
fi
install_package


case "$what" in
  demo) exec "$ENV_PY" examples/train_digits.py ;;
  test) shift  # with arguments: one pytest given them; without: the suite on every core (tests/parallel.py)
    if [ $# -gt 0 ]; then exec "$ENV_PY" -m pytest -q "$@"; else exec "$ENV_PY" tests/parallel.py; fi ;;
  bench) exec "$ENV_PY" bench/run.py ;;
  setup) say "set up: $ENV_PY"; [ "$ENV_ACTION" = use-active ] || say "activate it with: source .venv/bin/activate" ;;
esac
