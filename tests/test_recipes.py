"""The recipes of docs/architecture.md's "How to add ..." section, followed, so that a recipe that
goes stale fails here: every file and name the section mentions is where the section says (a
checker over its text), a model family written as recipe (a) says serves the checkpoint it was
written for, and a sampling parameter added as step 1 says is taken, checked and refused as that
step says. The metric recipe is all edits of product files, so the checker is its test; the
kernel recipe is followed in tests/kernels/test_recipe_kernel.py (under Triton's interpreter)."""
from __future__ import annotations

import ast
import io
import json
import keyword
import math
import re
import shutil
import sys
import textwrap
import tokenize
from dataclasses import dataclass, field, fields
from functools import cache
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
HEADING = "## How to add ..."
# The folders a file name the section gives without its folder is looked for in, and the ones
# whose Python defines the classes and functions it names.
SEARCHED = ("backend", "kernels", "frontend", "client", "scripts", "tests", "benchmarks")
PRODUCT = ("backend", "kernels", "frontend", "client")
# An item of the section: a recipe's title (level 0), a variant such as "(a)" (level 1), or a
# numbered step or a bullet (level 2); the lines up to the next item belong to it.
ITEM_START = {0: re.compile(r"\*\*"), 1: re.compile(r"\([a-z]\) "), 2: re.compile(r"(\d+\.|-) ")}
PATH = re.compile(r"[\w.<>*/-]+")
BARE_PATH = re.compile(r"\b[\w-]+(?:/[\w.-]+)+\.(?:py|md)\b")  # a path outside backticks
CALL = re.compile(r"([\w.<>]+)\((.*)\)", re.S)
DOTTED_MEMBER = re.compile(r"([A-Z]\w*)\.(\w+)")  # Class.member


def recipe_section(text: str) -> str:
    start = text.index(HEADING)
    end = text.find("\n## ", start + len(HEADING))
    return text[start + len(HEADING):end if end >= 0 else len(text)]


@dataclass
class Item:
    level: int
    text: str
    parents: list[Item] = field(default_factory=list)  # its recipe, then its variant


def items(section: str) -> list[Item]:
    """The section's items in order, each with the open items of lower levels above it."""
    out: list[Item] = []
    open_items: dict[int, Item] = {}  # the latest item of each level
    for line in section.splitlines():
        level = next((lv for lv, pattern in ITEM_START.items() if pattern.match(line)), None)
        if level is None:
            if out:
                out[-1].text += "\n" + line
            continue
        item = Item(level, line, [open_items[lv] for lv in sorted(open_items) if lv < level])
        open_items = {lv: it for lv, it in open_items.items() if lv < level} | {level: item}
        out.append(item)
    return out


def is_path(token: str) -> bool:
    return bool(PATH.fullmatch(token)) and ("/" in token or token.endswith((".py", ".md")))


def resolve(token: str) -> list[Path]:
    """The files (or folders) a path of the section names: from the root, from backend/ (the
    section's `models/...`, `engine/...`), or a bare file name found under SEARCHED. A placeholder
    (`<family>`) needs its folder; a glob, a match."""
    if "<" in token:
        token = token[:token.index("<")]
    if "*" in token:
        return sorted(ROOT.glob(token))
    for base in (ROOT, ROOT / "backend"):
        if token and (base / token).exists():
            return [base / token]
    if "/" not in token:
        return [p for tree in SEARCHED for p in (ROOT / tree).rglob(token)]
    return []


@cache
def words(path: Path) -> frozenset[str]:
    """The names a file holds: Python's identifiers and the words of its short string literals
    (config keys, option names; not docstrings), its own module path's parts; a Markdown
    file's words."""
    text = path.read_text(encoding="utf-8")
    found = set(path.relative_to(ROOT).with_suffix("").parts)
    if path.suffix != ".py":
        return frozenset(found | set(re.findall(r"\w+", text)))
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NAME:
            found.add(tok.string)
        elif tok.type == tokenize.STRING and len(tok.string) <= 80:
            found.update(re.findall(r"\w+", tok.string))
    return frozenset(found)


@cache
def definitions(path: Path) -> dict[str, list[str]]:
    """Each class, function and class member a Python file defines (`Class.member`), with the
    parameters it takes (a class: its __init__'s, else its annotated fields, a dataclass's)."""
    defs: dict[str, list[str]] = {}

    def params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
        return [a.arg for a in fn.args.posonlyargs + fn.args.args if a.arg not in ("self", "cls")]

    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs[node.name] = params(node)
        elif isinstance(node, ast.ClassDef):
            annotated = []
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defs[f"{node.name}.{member.name}"] = params(member)
                targets = (member.targets if isinstance(member, ast.Assign)
                           else [member.target] if isinstance(member, ast.AnnAssign) else [])
                for target in (t for t in targets if isinstance(t, ast.Name)):
                    defs[f"{node.name}.{target.id}"] = []
                    annotated += [target.id] if isinstance(member, ast.AnnAssign) else []
            defs[node.name] = defs.get(f"{node.name}.__init__", annotated)
    return defs


@cache
def all_python(trees: tuple[str, ...]) -> tuple[Path, ...]:
    return tuple(p for tree in trees for p in sorted((ROOT / tree).rglob("*.py")))


def defined(name: str, files: tuple[Path, ...]) -> list[str] | None:
    """The parameters of `name` as the first of `files` that defines it has them; None: none does."""
    return next((d[name] for d in map(definitions, files) if name in d), None)


@cache
def known_words(scope: tuple[Path, ...]) -> frozenset[str]:
    return frozenset().union(*map(words, scope or all_python(SEARCHED)))


def names(paths: tuple[Path, ...]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths][:8]


def check_token(token: str, scope: tuple[Path, ...]) -> str | None:
    """What is wrong with one backticked token of an item whose files (with its recipe's and
    variant's) are `scope`; None when it holds."""
    if is_path(token):
        return None if resolve(token) else f"`{token}` is not there"
    call = CALL.fullmatch(token)
    plain_call = call and "<" not in call[1] and all(a.strip().isidentifier() for a in call[2].split(","))
    if " = " in token or (call and "<" not in call[1] and call[2] != "..." and not plain_call):
        # a line of code, or a call with its arguments: as a file of the scope writes it
        texts = [" ".join(p.read_text(encoding="utf-8").split()) for p in scope if p.is_file()]
        return None if any(token in t for t in texts) else f"`{token}` is in none of {names(scope)}"
    if plain_call:  # a signature: the parameters' names, in order
        args = [a.strip() for a in call[2].split(",")]
        params = defined(call[1], scope)
        params = defined(call[1], all_python(PRODUCT)) if params is None else params
        return None if params is not None and params[:len(args)] == args else f"`{token}`: {call[1]} takes {params}"
    if DOTTED_MEMBER.fullmatch(token):
        return None if defined(token, all_python(PRODUCT)) is not None else f"no `{token}` is defined"
    if re.fullmatch(r"test_\w+", token):
        tests = tuple(p for p in scope if p.name.startswith("test_")) or all_python(("tests",))
        return None if defined(token, tests) is not None else f"no test `{token}` in {names(tests)}"
    known = known_words(scope)
    stripped = re.sub(r"\b\d[\w.]*", "", re.sub(r"<[^>]*>", "", token))  # placeholders, numbers
    missing = [w for w in re.findall(r"[A-Za-z_]\w*", stripped) if not keyword.iskeyword(w) and w not in known
               and not (w.startswith("_") and any(k.endswith(w) for k in known))]  # `_ref`: a suffix
    return f"`{token}`: {missing} in none of {names(scope)}" if missing else None


def tokens_of(text: str) -> list[str]:
    """The backticked tokens of an item (its lines joined), then the paths it gives bare."""
    tokens = [" ".join(t.split()) for t in re.findall(r"`([^`]+)`", text)]
    return tokens + BARE_PATH.findall(re.sub(r"`[^`]+`", "", text))


def python_scope(tokens: list[str]) -> tuple[Path, ...]:
    paths = [p for t in tokens if is_path(t) for p in resolve(t) if p.suffix != ".md"]
    return tuple(dict.fromkeys(q for p in paths for q in ([p] if p.is_file() else sorted(p.glob("*.py")))))


def section_problems(section: str) -> list[str]:
    """Every path the section gives must exist, and every name it gives must be in the files its
    item, or the item's recipe and variant, name (an item and parents that name none: the files of
    its whole recipe)."""
    problems = []
    recipes: list[list[Item]] = []
    for item in items(section):
        if item.level == 0 or not recipes:
            recipes.append([])
        recipes[-1].append(item)
    for recipe in recipes:
        whole = python_scope([t for item in recipe for t in tokens_of(item.text)])
        for item in recipe:
            tokens = tokens_of(item.text)
            scope = python_scope(tokens + [t for parent in item.parents for t in tokens_of(parent.text)]) or whole
            scope += tuple(p for t in tokens if t.endswith(".md") for p in resolve(t))
            title = item.text.splitlines()[0][:60]
            problems += [f"{title!r}: {p}" for t in tokens if (p := check_token(t, scope))]
    return problems


def test_every_file_and_name_the_recipes_give_is_where_they_say():
    assert section_problems(recipe_section(DOC.read_text(encoding="utf-8"))) == []


# A section in the recipes' form whose every name holds, for the checker's own test.
GOOD_SECTION = """
**A recipe**: its files
1. `frontend/sampling.py`: the name in `_PASS_THROUGH`; `Sampler.prepare` gathers it.
2. `kernels/validation_ops.py`, then `kernels/ops.py`: its `KernelOp(name, module, reference)` in `OPS`.
3. `engine/stats_snapshot.py` (`snapshot_stats`); `tests/engine/test_hf_parity.py`
   (`test_matches_hf_under_chunking_prefix_hits_and_preemption`).
(a) A variant: `backend/models/mixtral.py`, written as `backend/models/<family>.py`
- `config_defaults = {"norm_topk_prob": True, "router_weights_in_dtype": False}`, in the variant's file.
"""


def test_the_recipe_checker_finds_stale_names():
    """A renamed symbol, a moved file, a name in the wrong file, a changed signature, a changed
    line of code, a renamed test: each planted in a section whose names hold is reported, and
    nothing else."""
    assert section_problems(GOOD_SECTION) == []
    planted = {"`_PASS_THROUGH`": "`_PASS_THRU`", "`kernels/validation_ops.py`": "`kernels/validations.py`",
               "`Sampler.prepare`": "`Sampler.prepared`", "(`snapshot_stats`)": "(`get_stats`)",
               "`KernelOp(name, module, reference)`": "`KernelOp(name, reference, module)`",
               '"router_weights_in_dtype": False}`': '"router_weights_in_dtype": True}`',
               "`test_matches_hf_under_chunking": "`test_matches_hf_under_batching"}
    section = GOOD_SECTION
    for old, new in planted.items():
        section = section.replace(old, new)
    problems = section_problems(section)
    assert len(problems) == len(planted), problems
    for new in ("_PASS_THRU", "validations.py", "Sampler.prepared", "get_stats", "KernelOp(name, reference",
                '"router_weights_in_dtype": True', "under_batching"):
        assert any(new in p for p in problems), (new, problems)


# ---- A model architecture, (a): the family file as the section shows it, registered, serving ----

QWEN2 = dict(arch="qwen2", seed=2, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)
MAX_NEW = 8
CODE_INDENT = " " * 7  # a Markdown code block inside a numbered step: the step's three, plus four


def family_file(section: str) -> str:
    """Recipe (a) step 1's code block: the lines after the step's first that are blank or
    indented as code, up to the step's text again."""
    step = next(it for it in items(section) if it.level == 2 and "`backend/models/<family>.py`" in it.text)
    block = []
    for line in step.text.splitlines()[1:]:
        if line.strip() and not line.startswith(CODE_INDENT):
            break
        block.append(line)
    return textwrap.dedent("\n".join(block)).strip() + "\n"


def load_module(monkeypatch, name: str, path: Path, source: str) -> ModuleType:
    """`source` written to `path` and imported as the product module `name` (its relative imports
    are its package's), until the test ends."""
    path.write_text(source, encoding="utf-8")
    module = module_from_spec(spec_from_file_location(name, path))
    monkeypatch.setitem(sys.modules, name, module)
    module.__spec__.loader.exec_module(module)
    return module


def register(monkeypatch, cls: type) -> None:
    """Step 2: the class added to MODEL_CLASSES. The registry is MODEL_CLASSES's `architectures`
    names (checked here, so that this stays the module's own rule), rebuilt for the new tuple."""
    from tritium import models
    assert models.MODEL_REGISTRY == {a: c for c in models.MODEL_CLASSES for a in c.architectures}
    classes = (*models.MODEL_CLASSES, cls)
    monkeypatch.setattr(models, "MODEL_CLASSES", classes)
    monkeypatch.setattr(models, "MODEL_REGISTRY", {a: c for c in classes for a in c.architectures})


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> str:
    from scripts.build_default_model import build_model
    return build_model(str(tmp_path_factory.mktemp("tiny-qwen2")), **QWEN2)


def relabeled(model_dir: str, out: Path, cls: type) -> str:
    """A copy of the checkpoint whose config.json names the family, as one of its own would."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert "attention_bias" not in config  # Qwen2's q/k/v bias is implicit: the default must give it
    config.update(architectures=list(cls.architectures), model_type=cls.model_types[0])
    (out / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(out)


def test_a_family_that_differs_only_in_config_defaults(monkeypatch, tmp_path, qwen2_dir):
    """The section's FooForCausalLM (Llama's blocks with a q/k/v bias) serves a Qwen2 checkpoint
    labelled as its own with exactly transformers' greedy tokens for the original; without its
    `config_defaults` line the checkpoint's biases have no parameter to go to."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.engine.hf_reference import hf_greedy_generate
    from tritium import LLM, SamplingParams
    from tritium.models import get_model_class

    source = family_file(recipe_section(DOC.read_text(encoding="utf-8")))
    assert "config_defaults = {" in source
    without = "".join(line for line in source.splitlines(keepends=True) if "config_defaults" not in line)
    bare = load_module(monkeypatch, "tritium.models.foo_without_defaults", tmp_path / "bare.py", without)
    assert bare.FooForCausalLM.config_defaults == {}
    foo = load_module(monkeypatch, "tritium.models.foo", tmp_path / "foo.py", source).FooForCausalLM
    model_dir = relabeled(qwen2_dir, tmp_path / "foo-checkpoint", foo)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    with monkeypatch.context() as without_defaults:
        register(without_defaults, bare.FooForCausalLM)
        with pytest.raises(ValueError, match=r"_proj\.bias' has no matching parameter"):
            LLM(model_dir, device="cpu", dtype="float32")

    register(monkeypatch, foo)
    config = json.loads(Path(model_dir, "config.json").read_text(encoding="utf-8"))
    assert get_model_class(config) is foo  # by `architectures`
    assert get_model_class({"model_type": "foo"}) is foo  # then by `model_types`
    tokenizer = AutoTokenizer.from_pretrained(qwen2_dir)
    prompts = [tokenizer(text)["input_ids"] for text in ("The engine streams tokens", "cache block 日本")]
    want = hf_greedy_generate(AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32), prompts,
                              MAX_NEW)
    with LLM(model_dir, device="cpu", dtype="float32") as llm:
        assert type(llm.engine.executor.worker.model) is foo and llm.engine.executor.worker.model.config.attention_bias
        assert [out.outputs[0].token_ids for out in llm.generate(prompts, params)] == want


def test_config_json_wins_where_the_recipe_says_and_defaults_name_fields():
    """(a) step 1: `config_defaults` names DecoderConfig fields (and the sliding-window rule);
    config.json's own value wins for the fields the section lists, the family's for every other."""
    from tritium.models import MODEL_CLASSES
    from tritium.models.decoder_config import DecoderConfig

    section = recipe_section(DOC.read_text(encoding="utf-8"))
    listed = re.search(r"config\.json's own (.+?) still win", section, re.S)
    assert listed, "the sentence saying which config.json fields win is gone"
    documented = set(re.findall(r"`(\w+)`", listed[1]))
    for cls in MODEL_CLASSES:
        assert set(cls.config_defaults) - {"windowed_layers"} <= {f.name for f in fields(DecoderConfig)}, cls
    base = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2}  # experts: norm_topk_prob
    switches = [f.name for f in fields(DecoderConfig) if f.type == "bool"]
    # Each switch read with the family's default one way and config.json's value the other.
    read = {name: [getattr(DecoderConfig.from_hf_config({**base, name: not v}, **{name: v}), name)
                   for v in (True, False)] for name in switches}
    assert {name for name, got in read.items() if got == [False, True]} == documented  # config.json's
    assert {name for name, got in read.items() if got == [True, False]} == set(switches) - documented


def test_mixtral_is_recipe_b_without_a_make_mlp():
    from tritium.models.decoder import DecoderForCausalLM
    from tritium.models.mixtral import MixtralForCausalLM
    assert MixtralForCausalLM.make_mlp is DecoderForCausalLM.make_mlp


# ---- A sampling parameter, step 1: a subclass stands in for the edited SamplingParams ----------

def test_a_sampling_parameter_step_one(monkeypatch):
    """The field with its default and its check in `_verify` (run by __post_init__, a
    ParameterError naming it); `from_dict` refuses it until `_PUBLIC_FIELDS` has it; NaN passes
    its own check and only `_FLOAT_FIELDS` refuses it."""
    from tritium import ParameterError, SamplingParams
    from tritium import sampling_params

    @dataclass
    class WithFooPenalty(SamplingParams):
        foo_penalty: float = 0.0

        def _verify(self) -> None:
            super()._verify()
            if self.foo_penalty < 0:
                raise ParameterError(f"foo_penalty must be non-negative, got {self.foo_penalty}.", "foo_penalty")

    assert WithFooPenalty().foo_penalty == 0.0
    with pytest.raises(ParameterError, match="Unknown sampling parameter 'foo_penalty'") as unknown:
        WithFooPenalty.from_dict({"foo_penalty": 0.5})
    assert unknown.value.parameter == "foo_penalty"
    monkeypatch.setitem(sampling_params._PUBLIC_FIELDS, "foo_penalty", "float")
    assert WithFooPenalty.from_dict({"foo_penalty": "0.5", "temperature": 0}).foo_penalty == 0.5
    with pytest.raises(ParameterError, match="non-negative") as refused:
        WithFooPenalty.from_dict({"foo_penalty": -1})
    assert refused.value.parameter == "foo_penalty"
    assert math.isnan(WithFooPenalty.from_dict({"foo_penalty": "nan"}).foo_penalty)  # its own check lets NaN by
    monkeypatch.setattr(sampling_params, "_FLOAT_FIELDS", (*sampling_params._FLOAT_FIELDS, "foo_penalty"))
    with pytest.raises(ParameterError, match="foo_penalty must be a finite number") as not_finite:
        WithFooPenalty.from_dict({"foo_penalty": "nan"})
    assert not_finite.value.parameter == "foo_penalty"
