"""Make a throw-away Triton model repository for a benchmark run: a copy of
model_repository/llm whose engine-argument parameters are replaced or added.

    python -m benchmarks.loadgen.bench_model_repo --dest /tmp/repo --set model=/abs/models/configs/llama-3-8b \
        --set load_format=dummy --set dtype=bfloat16
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PARAM = re.compile(
    r'parameters\s*:?\s*\{\s*key\s*:\s*"(?P<key>[^"]+)"\s*value\s*:?\s*\{\s*string_value\s*:\s*'
    r'"(?P<value>(?:[^"\\]|\\.)*)"\s*\}\s*\}')


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def set_parameters(pbtxt: str, values: dict[str, str]) -> str:
    """`pbtxt` with each key's string parameter set to its value: replaced in place where the
    key exists (every occurrence), appended at the end otherwise."""
    seen: set[str] = set()

    def replace(m: re.Match[str]) -> str:
        key = m.group("key")
        if key not in values:
            return m.group(0)
        seen.add(key)
        return f'parameters {{ key: "{key}" value {{ string_value: "{_quote(values[key])}" }} }}'

    out = _PARAM.sub(replace, pbtxt)
    missing = [k for k in values if k not in seen]
    if missing:
        out = out.rstrip("\n") + "\n" + "".join(
            f'parameters {{ key: "{k}" value {{ string_value: "{_quote(values[k])}" }} }}\n' for k in missing)
    return out


def get_parameters(pbtxt: str) -> dict[str, str]:
    """{key: string_value} of every string parameter, unescaped."""
    return {m.group("key"): re.sub(r"\\(.)", r"\1", m.group("value")) for m in _PARAM.finditer(pbtxt)}


def parse_assignments(items: list[str]) -> dict[str, str]:
    """['k=v', ...] -> {k: v}; the value may contain '='."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected KEY=VALUE, got {item!r}.")
        out[key.strip()] = value
    return out


def make_repository(dest: str, values: dict[str, str], source: str, name: str = "llm") -> str:
    """Copy `source` (a model directory) to dest/name with the parameters set; returns dest."""
    target = os.path.join(dest, name)
    if os.path.exists(target):
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    path = os.path.join(target, "config.pbtxt")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(set_parameters(text, values))
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", required=True, help="repository directory to (re)create the model in")
    ap.add_argument("--source", default=os.path.join(ROOT, "model_repository", "llm"))
    ap.add_argument("--name", default="llm")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    values = parse_assignments(args.set)
    make_repository(args.dest, values, args.source, args.name)
    with open(os.path.join(args.dest, args.name, "config.pbtxt"), encoding="utf-8") as f:
        params = get_parameters(f.read())
    print(" ".join(f"{k}={v}" for k, v in params.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
