"""The layering the architecture guide promises (docs/architecture.md, "The layers"): packages
import one way, and no module imports itself back through others. Every import counts: at the
top of a module, inside a function, and under `if TYPE_CHECKING:`."""
from __future__ import annotations

import ast
import os
import re
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOADGEN = "benchmarks/loadgen"
TREES = ("backend", "frontend", "kernels", LOADGEN)
# The import name of each folder (pyproject.toml / setup.py): backend/ is the `tritium` package.
IMPORT_NAMES = {"backend": "tritium", "kernels": "tritium.kernels", "frontend": "tritium.frontend",
                "client": "tritium.client", LOADGEN: "tritium.bench"}

# Each module's layer: a package's modules are its package's (the first entry that names it);
# the public names (backend/__init__, backend/llm.py) are "api"; backend's other top-level modules
# (config, sampling params, the step contract, outputs, ...) are "records". A layer imports only
# its own and the layers after it.
PACKAGE_LAYERS = {
    # The `tritium` command and the server launcher: above everything, imported by nothing.
    "tritium.cli": "cli",
    "tritium.launch": "cli",
    "tritium.serving": "serving",
    "tritium.drivers": "drivers",
    "tritium.engine": "engine",
    "tritium.core": "core",
    "tritium.worker": "worker",
    # Moving KV blocks between engine instances works on the worker's cache tensors.
    "tritium.kv_transfer": "worker",
    # Speculative decoding is one package whose modules sit at the level of what they use: the
    # proposers that run a model are the worker's (its graphs, batches, model builder), the draft
    # vocabulary check loads the engine's tokenizer; the rest (what a proposer is, n-gram lookup,
    # verification, the counters) sits below the layers, whose sampler verifies with it.
    "tritium.spec_decode.draft_model": "worker",
    "tritium.spec_decode.eagle": "worker",
    "tritium.spec_decode.vocabulary": "engine",
    "tritium.spec_decode": "spec_decode",
    "tritium.models": "models",
    "tritium.layers": "layers",
    "tritium.kernels": "kernels",
    "tritium.frontend": "frontend",
    "tritium.bench": "bench",
}
API = ("tritium", "tritium.llm")
# The serving side (the Triton adapter and what it needs) uses the public names like any client.
LAYERS = ("cli", "serving", "api", "drivers", "engine", "core", "worker", "models", "layers", "spec_decode", "records",
          "kernels")
# The OpenAI frontend is a separate process that speaks Triton's gRPC: it may load the engine's
# tokenizer code (tritium.engine.tokenizer), nothing that runs a model.
FRONTEND_MAY_IMPORT = ("tritium.engine.tokenizer",)
# The load generator (benchmarks/loadgen/, `tritium bench`) is a client of the servers: it imports
# nothing of the rest, and only the command imports it.
SPEC_DECODE = "tritium.spec_decode"
# The scheduling core (scheduler, KV-cache manager and block pools, sequences) is plain Python: it
# imports the standard library, backend's records and itself, so that it runs without torch.
CORE = "tritium.core"
# Speculative decoding's own kinds of names: a proposer, and what verifies proposals.
SPEC_DECODE_NAMES = re.compile(r"Proposer$|verify_drafts|verification_runs|rejection_sampl|num_accepted|WithProposals")


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int


def _modules(root: str, trees=TREES) -> dict[str, str]:
    out = {}
    for tree in trees:
        for d, _, files in os.walk(os.path.join(root, tree)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    rel = os.path.relpath(path, os.path.join(root, tree))[:-3].replace(os.sep, ".")
                    name = f"{IMPORT_NAMES[tree]}.{rel}"
                    out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: str, name: str, modules: dict[str, str]) -> list[Import]:
    """Every import of `name` of a module in `modules`, wherever it stands in the file."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[:len(parts) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            # `from package import module` imports the module; `from module import name`, the module
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for target in dict.fromkeys(targets):
            if target in modules and target != name:
                found.append(Import(name, target, node.lineno))
    return found


def _layer(module: str) -> str:
    if module in API:
        return "api"
    for package, layer in PACKAGE_LAYERS.items():
        if module == package or module.startswith(package + "."):
            return layer
    assert module.startswith("tritium."), module
    return "records"


def layering_violations(imports: list[Import]) -> list[str]:
    out = []
    for imp in imports:
        src, dst = _layer(imp.source), _layer(imp.target)
        if src == "bench" or dst == "bench":
            ok = src == dst or src == "cli"
        elif src == "frontend" or dst == "frontend":
            ok = (src == dst) or (src == "frontend" and imp.target in FRONTEND_MAY_IMPORT)
        else:
            ok = LAYERS.index(dst) >= LAYERS.index(src)
        if not ok:
            out.append(f"{imp.source} (line {imp.line}, layer {src}) imports {imp.target} (layer {dst})")
    return out


def import_cycle(imports: list[Import]) -> list[str] | None:
    """A cycle of module imports, or None. A module importing a package above it is not an edge
    (importing any module runs its packages' __init__ first, so it is everyone's)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.target, set())
        if not imp.source.startswith(imp.target + "."):
            graph.setdefault(imp.source, set()).add(imp.target)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def all_imports(root: str = ROOT, trees=TREES) -> list[Import]:
    modules = _modules(root, trees)
    return [imp for name, path in modules.items() for imp in _imports(path, name, modules)]


def test_no_import_cycle_in_backend_frontend_or_kernels():
    cycle = import_cycle(all_imports())
    assert cycle is None, " -> ".join(cycle)


def test_packages_import_one_way():
    """layers and models import nothing of worker, core, engine, drivers or serving (models
    import layers, not the other way); worker nothing of core, engine, drivers or serving; core
    nothing of engine, drivers or serving; engine nothing of drivers or serving; drivers nothing
    of serving; speculative decoding's core (backend/spec_decode/ but its model proposers and
    vocabulary check) nothing of any of them; the records (config, sampling_params, step, ...) nothing of any package;
    kernels nothing of backend."""
    assert layering_violations(all_imports()) == []


def _imported_names(path: str, name: str) -> list[tuple[str, int]]:
    """Every module name a module imports (relative imports resolved), with its line."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[:len(parts) - node.level + 1] if node.level else []
            found.append((".".join(base + ([node.module] if node.module else [])), node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
    return found


def core_impurities(root: str = ROOT) -> list[str]:
    """Every import of a module of backend/core/ that is not of the standard library, of
    backend's records or of the core itself."""
    out = []
    for name, path in _modules(root, ("backend",)).items():
        if name != CORE and not name.startswith(CORE + "."):
            continue
        for target, line in _imported_names(path, name):
            top = target.partition(".")[0]
            ok = (top in sys.stdlib_module_names or top == "__future__" or target == CORE
                  or target.startswith(CORE + ".")
                  or (target.startswith("tritium.") and _layer(target) == "records"))
            if not ok:
                out.append(f"{name} (line {line}) imports {target}")
    return out


def test_the_scheduling_core_is_plain_python():
    """backend/core/ (scheduler, block manager and pools, sequences) imports no torch, no
    tokenizer, nothing of the engine or the worker: its tests run it with ten blocks, no model."""
    assert core_impurities() == []
    modules = _modules(ROOT, ("backend",))
    for name in ("scheduler", "scheduler_output", "worker_view", "block_manager", "block_hash",
                 "host_block_pool", "host_prefix_cache", "kv_swap", "lora_slots", "sequence"):
        assert f"{CORE}.{name}" in modules, name


def test_the_core_check_finds_planted_imports(tmp_path):
    """A core module importing torch, the engine's tokenizer (even under TYPE_CHECKING) or
    numpy is reported; the standard library, a record and the core itself are not."""
    files = {
        "backend/__init__.py": "",
        "backend/step.py": "",
        "backend/engine/__init__.py": "",
        "backend/engine/tokenizer.py": "",
        "backend/core/__init__.py": "",
        "backend/core/sequence.py": "import itertools\nfrom ..step import PLACEHOLDER\n",
        "backend/core/scheduler.py": ("from typing import TYPE_CHECKING\nimport torch\nfrom .sequence import S\n"
                                      "if TYPE_CHECKING:\n    from ..engine.tokenizer import D\n"
                                      "def f():\n    import numpy\n"),
    }
    for rel, text in files.items():
        os.makedirs(os.path.dirname(tmp_path / rel), exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert sorted(core_impurities(str(tmp_path))) == [
        "tritium.core.scheduler (line 2) imports torch",
        "tritium.core.scheduler (line 5) imports tritium.engine.tokenizer",
        "tritium.core.scheduler (line 7) imports numpy"]


def spec_decode_outside(root: str = ROOT, trees=TREES) -> list[str]:
    """Every class or function outside backend/spec_decode/ whose name says it proposes or
    verifies proposals (`SPEC_DECODE_NAMES`)."""
    out = []
    for name, path in _modules(root, trees).items():
        if name == SPEC_DECODE or name.startswith(SPEC_DECODE + "."):
            continue
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and SPEC_DECODE_NAMES.search(node.name):
                out.append(f"{name} (line {node.lineno}) defines {node.name}")
    return out


def test_speculative_decoding_lives_in_spec_decode():
    """Proposers (n-gram, draft model, EAGLE) and the verification of their proposals are
    defined in backend/spec_decode/ only; the engine, the worker and the sampler call it."""
    assert spec_decode_outside() == []
    modules = _modules(ROOT, ("backend",))
    for name in ("proposer", "ngram", "draft_model", "eagle", "verification", "vocabulary", "metrics"):
        assert f"{SPEC_DECODE}.{name}" in modules, name


def test_the_spec_decode_checks_find_a_planted_proposer_verifier_and_upward_import(tmp_path):
    """A proposer class and a draft verifier outside backend/spec_decode/ are reported, the same
    names inside it are not; spec_decode's core importing the worker, and the layers importing
    a model proposer (the worker's level), are layering violations."""
    files = {
        "backend/__init__.py": "",
        "backend/worker/__init__.py": "",
        "backend/worker/input_batch.py": "",
        "backend/worker/ngram_proposer.py": "class NgramProposer:\n    def propose(self):\n        pass\n",
        "backend/layers/__init__.py": "",
        "backend/layers/sampler.py": ("from ..spec_decode.draft_model import DraftOut\n\n\n"
                                      "def _verify_drafts(probs):\n    pass\n"),
        "backend/spec_decode/__init__.py": "",
        "backend/spec_decode/draft_model.py": "from ..worker.input_batch import PreparedBatch\n",
        "backend/spec_decode/ngram.py": "class NgramProposer:\n    pass\n",
        "backend/spec_decode/verification.py": ("from ..worker.input_batch import PreparedBatch\n\n\n"
                                                 "def verify_drafts(probs):\n    pass\n"),
    }
    for rel, text in files.items():
        os.makedirs(os.path.dirname(tmp_path / rel), exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert sorted(spec_decode_outside(str(tmp_path), ("backend",))) == [
        "tritium.layers.sampler (line 4) defines _verify_drafts",
        "tritium.worker.ngram_proposer (line 1) defines NgramProposer"]
    assert sorted(layering_violations(all_imports(str(tmp_path), ("backend",)))) == [
        "tritium.layers.sampler (line 1, layer layers) imports tritium.spec_decode.draft_model (layer worker)",
        "tritium.spec_decode.verification (line 1, layer spec_decode) imports tritium.worker.input_batch "
        "(layer worker)"]


def test_the_checker_finds_a_planted_violation_and_cycle(tmp_path):
    """The checks above fail on a tree that breaks them: a layer that imports the core under
    TYPE_CHECKING, and a cycle closed by a function-local import."""
    files = {
        "backend/__init__.py": "",
        "backend/config.py": "",
        "backend/core/__init__.py": "",
        "backend/core/sequence.py": "from ..config import X\n",
        "backend/layers/__init__.py": "",
        "backend/layers/penalties.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                        "    from ..core.sequence import Sequence\n"),
        "kernels/__init__.py": "",
        "kernels/a.py": "from .b import f\n",
        "kernels/b.py": "def f():\n    from . import a\n",
    }
    for rel, text in files.items():
        os.makedirs(os.path.dirname(tmp_path / rel), exist_ok=True)
        (tmp_path / rel).write_text(text)
    imports = all_imports(str(tmp_path))
    assert layering_violations(imports) == [
        "tritium.layers.penalties (line 3, layer layers) imports tritium.core.sequence (layer core)"]
    assert import_cycle(imports) == ["tritium.kernels.a", "tritium.kernels.b", "tritium.kernels.a"]
    (tmp_path / "kernels/b.py").write_text("def f():\n    pass\n")
    (tmp_path / "backend/layers/penalties.py").write_text("from ..config import X\n")
    imports = all_imports(str(tmp_path))
    assert layering_violations(imports) == [] and import_cycle(imports) is None


def test_the_commands_are_on_top_and_the_load_generator_apart(tmp_path):
    """Nothing imports the `tritium` command or the launcher; the load generator imports nothing of
    the engine, and only the command imports it."""
    files = {
        "backend/__init__.py": "",
        "backend/config.py": "",
        "backend/cli/__init__.py": "from ..serving import x\nfrom tritium.bench import bench\n",
        "backend/launch/__init__.py": "",
        "backend/launch/tritonserver.py": "",
        "backend/serving/__init__.py": "",
        "backend/serving/x.py": "from ..launch import tritonserver\n",
        "benchmarks/loadgen/__init__.py": "",
        "benchmarks/loadgen/bench.py": "from . import workloads\nfrom tritium.config import EngineArgs\n",
        "benchmarks/loadgen/workloads.py": "",
    }
    for rel, text in files.items():
        os.makedirs(os.path.dirname(tmp_path / rel), exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert sorted(layering_violations(all_imports(str(tmp_path)))) == [
        "tritium.bench.bench (line 2, layer bench) imports tritium.config (layer records)",
        "tritium.serving.x (line 1, layer serving) imports tritium.launch.tritonserver (layer cli)"]


ADAPTER = "tritium.serving.model"  # the `tritium` Triton backend: the one module Triton imports


def test_only_the_adapter_imports_triton_and_nothing_imports_it():
    modules = _modules(ROOT, ("backend", "kernels"))
    adapter = ast.parse(open(modules[ADAPTER], encoding="utf-8").read())
    assert any(a.name == "triton_python_backend_utils" for n in ast.walk(adapter)
               if isinstance(n, ast.Import) for a in n.names)
    for name, path in modules.items():
        if name == ADAPTER:
            continue
        tree = ast.parse(open(path, encoding="utf-8").read())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "triton_python_backend_utils" not in imported, name
        assert ADAPTER not in imported and not any(
            n.module == "tritium.serving" and any(a.name == "model" for a in n.names)
            for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)), name
        if name.startswith("kernels"):
            assert not any(m == "backend" or m.startswith("backend.") for m in imported), name


def test_model_py_is_an_adapter_and_modules_stay_small():
    with open(os.path.join(ROOT, "backend", "serving", "model.py"), encoding="utf-8") as f:
        assert len(f.readlines()) < 200
    for name, path in _modules(ROOT, ("backend", "kernels")).items():
        with open(path, encoding="utf-8") as f:
            assert len(f.readlines()) <= 420, name


def test_nothing_edits_sys_path():
    """The product imports as the installed `tritium` package, and the checkout's own folders
    (scripts/, tests/, benchmarks/) by their names from its root: no file edits the import path."""
    import subprocess
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.sh", "scripts/tritonserver"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    needle = "sys" + ".path"  # spelled apart, so that this file does not find itself
    found = [f"{rel}:{n}" for rel in tracked if not rel.startswith("gpu_bundle/")
             for n, line in enumerate(open(os.path.join(ROOT, rel), encoding="utf-8"), 1) if needle in line]
    assert found == []


def test_nothing_imports_the_folders_by_their_own_names():
    """`backend`, `kernels`, `frontend` and `client` are folders, not import names: run from the
    checkout's root they would still import, and hide code that an installed package breaks."""
    import subprocess
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    found = []
    for rel in (r for r in tracked if not r.startswith("gpu_bundle/")):
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, rel), encoding="utf-8").read())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{rel}:{node.lineno} {n}" for n in names if n.partition(".")[0] in IMPORT_NAMES]
    assert found == []
