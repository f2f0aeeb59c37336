# sourced by each call of session 14's real-target study: wheels under /root (kept while the machine is warm)
export PYTHONPATH=/root/site:$PWD PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE  # a user's install has bytecode caches: the second process on does not recompile
E=/root/ex; DF="python3 -m dflash.cli"; REPO=$PWD
quiet() { tr '\r' '\n' | grep -v "sample/s\]\|it/s\]\|row/s\]\|s/it\]\|step/s\]\|^\s*$"; }
