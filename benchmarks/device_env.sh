# Source this on a GPU machine where mhattn cannot be pip-installed (no network): it makes `import mhattn`
# work from this checkout by laying the installed package shape (mhattn/, mhattn/backends, mhattn/reference)
# out of symlinks in a temporary folder put on PYTHONPATH.
#   source benchmarks/device_env.sh
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_site="${MHATTN_SITE:-/tmp/mhattn_site}"
rm -rf "$_site" && mkdir -p "$_site/mhattn"
for _f in "$_repo"/mhattn/*; do ln -s "$_f" "$_site/mhattn/$(basename "$_f")"; done
ln -s "$_repo/backends" "$_site/mhattn/backends"
ln -s "$_repo/reference" "$_site/mhattn/reference"
export PYTHONPATH="$_site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
mhattn() { python3 -m mhattn.cli "$@"; }
python3 -c 'import torch, mhattn; print("mhattn", mhattn.__version__, "torch", torch.__version__, "cuda", torch.cuda.is_available())'
