#!/usr/bin/env bash
# SGLang's own frontend (the real `sglang` package, without its runtime's dependencies) in a folder of its own, for
# the test that runs SGLang programs against `deepinfer serve` (test/server/test_sglang_frontend.py). The folder
# goes on that test's subprocess PYTHONPATH only, so nothing here shadows the project's own packages.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${DEEPINFER_SGLANG_FRONTEND:-.sglang-frontend}
[ -f "$TARGET/sglang/__init__.py" ] && exit 0
python -m pip install -q --no-deps --target "$TARGET" sglang==0.5.23 pybase64 pillow msgspec aiohttp multidict \
  yarl propcache aiohappyeyeballs aiosignal frozenlist orjson ipython traitlets
