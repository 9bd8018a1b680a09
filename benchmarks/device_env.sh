# Source this on a GPU machine with no network to make `import mhattn` work from this checkout:
#   source benchmarks/device_env.sh
# First choice: an editable install without dependencies or build isolation (needs setuptools there), which
# maps mhattn.backends and mhattn.reference as pyproject.toml says and works from the repo root too.
# Fallback: the installed package shape laid out of symlinks in a folder put on PYTHONPATH (then run
# python from outside the repo root, with -P, so the raw ./mhattn folder does not shadow it).
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONUNBUFFERED=1
if ! (cd "$_repo" && python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/mhattn_pip.log 2>&1); then
  echo "editable install failed (see /tmp/mhattn_pip.log); using a symlinked package on PYTHONPATH"
  _site="${MHATTN_SITE:-/tmp/mhattn_site}"
  rm -rf "$_site" && mkdir -p "$_site/mhattn"
  for _f in "$_repo"/mhattn/*; do ln -s "$_f" "$_site/mhattn/$(basename "$_f")"; done
  ln -s "$_repo/backends" "$_site/mhattn/backends"
  ln -s "$_repo/reference" "$_site/mhattn/reference"
  export PYTHONPATH="$_site${PYTHONPATH:+:$PYTHONPATH}"
fi
mhattn() { python3 -m mhattn.cli "$@"; }
(cd /tmp && python3 -c 'import torch, mhattn, mhattn.backends.base; print("mhattn", mhattn.__version__, "torch", torch.__version__, "cuda", torch.cuda.is_available())')
