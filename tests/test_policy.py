"""mixprec.policy: tables checked against torch's dispatcher and torch's own autocast op lists."""

from __future__ import annotations

import ast
import copy
import dataclasses
import gc
import pickle
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import load_torch_autocast_lists

from mixprec import policy as P
from mixprec.policy import Action, OpRule, PolicyError, Source, tables

DISPATCH_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}


@pytest.fixture(autouse=True)
def _clean_registry(clean_registry: None) -> None:
    """Every test here starts and ends without global registrations."""


@pytest.fixture(scope="module")
def torch_lists() -> types.ModuleType:
    return load_torch_autocast_lists()


# ---- the tables mirror torch ---------------------------------------------------------------------------


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_table_lists_exactly_the_ops_torch_registers_autocast_kernels_for(device_type: str) -> None:
    # The dispatcher knows which ops have an autocast kernel per device (CUDA's are registered even in a
    # CPU build), so this checks the CUDA table on a CPU-only machine too.
    registered = torch._C._dispatch_get_registrations_for_dispatch_key(DISPATCH_KEYS[device_type])
    torch_ops = {P.op_name(name) for name in registered}
    ours = {r.op for r in P.TORCH_NATIVE.table(device_type).rules}
    diff = (sorted(ours - torch_ops), sorted(torch_ops - ours))
    major, minor = tables.TABLES_TORCH_VERSION
    same_release = (major, minor) <= torch.__version__ < (major, minor + 1)  # TorchVersion compares tuples
    if ours != torch_ops and not same_release:
        pytest.skip(f"the tables mirror torch {tables.TABLES_TORCH_VERSION}; torch {torch.__version__} "
                    f"differs by (ours only, its only) {diff}")
    assert ours == torch_ops, diff


def _names(entries: list[tuple]) -> set[str]:
    return {P.op_name(entry[0]) for entry in entries}


def test_cpu_categories_match_torch_op_lists(torch_lists: types.ModuleType) -> None:
    with torch.random.fork_rng(devices=[]):  # the lists draw random tensors: leave the global RNG alone
        lists = torch_lists.AutocastCPUTestLists("cpu")
    expected = {
        Action.LOWER: _names(lists.torch_16) | _names(lists.nn_16),
        Action.FP32: _names(lists.torch_fp32) | _names(lists.nn_fp32),
        Action.PROMOTE: _names(lists.torch_need_autocast_promote),
    }
    for action, ops in expected.items():
        for op in ops:
            for dtype in (torch.bfloat16, torch.float16):
                assert P.TORCH_NATIVE.action(op, "cpu", dtype) is action, (op, dtype)


def test_cuda_categories_match_torch_op_lists(torch_lists: types.ModuleType) -> None:
    with torch.random.fork_rng(devices=[]):  # tensors on CPU: only the names are used here
        lists = torch_lists.AutocastTestLists("cpu")
    expected = {
        Action.LOWER: _names(lists.torch_fp16)
        | _names(lists.nn_fp16)
        | _names(lists.linalg_fp16)
        | _names(lists.methods_fp16),
        Action.FP32: _names(lists.torch_fp32) | _names(lists.nn_fp32) | _names(lists.methods_fp32),
        Action.PROMOTE: _names(lists.torch_need_autocast_promote),
        Action.BANNED: _names(lists.banned),
    }
    for action, ops in expected.items():
        for op in ops:
            for dtype in (torch.float16, torch.bfloat16):
                assert P.TORCH_NATIVE.action(op, "cuda", dtype) is action, (op, dtype)


def test_default_preset_is_torch_plus_documented_deviations_only() -> None:
    assert P.DEFAULT_POLICY is P.TORCH is P.get_preset("torch")
    for device_type, rule in P.TORCH.deviations():
        assert rule.source is Source.MIXPREC and rule.reason, (device_type, rule)
    # torch-sourced rules are identical to the strict mirror
    for table in P.TORCH.tables:
        torch_rules = tuple(r for r in table.rules if r.source is Source.TORCH)
        assert torch_rules == P.TORCH_NATIVE.table(table.device_type).rules


def test_every_preset_deviation_says_why() -> None:
    for preset in P.PRESETS.values():
        for _, rule in preset.deviations():
            assert len(rule.reason) > 20, rule
    with pytest.raises(PolicyError, match="reason"):
        OpRule("gelu", Action.FP32, source=Source.MIXPREC)


def test_default_policy_needs_no_python_layer_where_torch_does_it_all() -> None:
    assert P.TORCH.overrides("cpu", torch.bfloat16) == {}
    assert P.TORCH.overrides("cuda", torch.float16) == {}
    assert P.TORCH.overrides("cpu", torch.float16) == {"binary_cross_entropy": Action.BANNED}
    assert P.TORCH_NATIVE.overrides("cpu", torch.float16) == {}


def test_cpu_and_cuda_tables_differ_where_torch_does() -> None:
    assert P.TORCH.action("softmax", "cuda", torch.float16) is Action.FP32
    assert P.TORCH.action("softmax", "cpu", torch.bfloat16) is Action.NATIVE
    assert P.TORCH.action("exp", "cpu", torch.bfloat16) is Action.NATIVE
    assert P.TORCH.action("binary_cross_entropy", "cuda", torch.bfloat16) is Action.BANNED
    assert P.TORCH.action("binary_cross_entropy", "cpu", torch.bfloat16) is Action.FP32
    assert P.TORCH.action("binary_cross_entropy", "cpu", torch.float16) is Action.BANNED


def test_apex_preset_adds_fp32_ops_on_top_of_the_default() -> None:
    for op in ("softmax", "gelu", "cross_entropy_loss", "layer_norm", "sum"):
        assert P.APEX.action(op, "cpu", torch.bfloat16) is Action.FP32, op
    assert P.APEX.action("gelu", "cuda", torch.float16) is Action.FP32
    assert P.APEX.action("mm", "cpu", torch.bfloat16) is Action.LOWER


# ---- the data model -------------------------------------------------------------------------------------


def test_policies_are_frozen_and_with_methods_return_new_ones() -> None:
    base = P.TORCH
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.name = "x"  # type: ignore[misc]
    changed = base.with_fp32("gelu", device_type="cpu", reason="test")
    assert changed is not base and changed != base
    assert base.action("gelu", "cpu", torch.bfloat16) is Action.NATIVE
    assert changed.action("gelu", "cpu", torch.bfloat16) is Action.FP32
    assert changed.action("gelu", "cuda", torch.float16) is Action.NATIVE
    only_fp16 = base.with_lower(torch.cdist, dtypes=(torch.float16,))
    assert only_fp16.action("cdist", "cpu", torch.float16) is Action.LOWER
    assert only_fp16.action("cdist", "cpu", torch.bfloat16) is Action.FP32
    assert base.with_native("mm").action("mm", "cpu", torch.bfloat16) is Action.NATIVE
    assert hash(base) == hash(P.get_preset("torch"))
    assert base.with_fp32_modules(torch.nn.LayerNorm, "MyBlock").fp32_modules == (
        "torch.nn.modules.normalization.LayerNorm",
        "MyBlock",
    )
    assert base.with_emulate_fp16(False).emulate_fp16 is False


def test_later_rules_win() -> None:
    policy = P.TORCH.with_fp32("mm").with_promote("mm")
    assert policy.action("mm", "cpu", torch.bfloat16) is Action.PROMOTE


def test_op_name_normalizes_every_spelling() -> None:
    assert P.op_name("mm") == "mm"
    assert P.op_name("aten::softmax.int") == "softmax"
    assert P.op_name("aten.addmm.default") == "addmm"
    assert P.op_name(torch.ops.aten.mm.default) == "mm"
    assert P.op_name(torch.ops.aten.mm) == "mm"
    assert P.op_name(torch.Tensor.__matmul__) == "matmul"
    assert P.op_name(torch.Tensor.softmax) == "softmax"
    assert P.op_name(F.cross_entropy) == "cross_entropy_loss"
    assert P.op_name(F.linear) == "linear"
    assert P.op_name(torch.linalg.vecdot) == "linalg_vecdot"

    def my_op(x: torch.Tensor) -> torch.Tensor:
        return x

    assert P.op_name(my_op) == f"{__name__}.test_op_name_normalizes_every_spelling.<locals>.my_op"
    with pytest.raises(PolicyError, match="pass an op name"):
        P.op_name(42)


def test_lookup_answers_what_the_policy_does_with_an_op() -> None:
    rule = P.lookup(torch.mm, "cpu", torch.bfloat16)
    assert rule is not None and rule.action is Action.LOWER and rule.source is Source.TORCH
    assert P.lookup(torch.exp, "cpu", torch.bfloat16) is None  # unlisted: runs in its input dtype
    rule = P.lookup(torch.exp, "cuda", torch.float16)
    assert rule is not None and rule.action is Action.FP32
    rule = P.lookup("binary_cross_entropy", "cpu", torch.float16)
    assert rule is not None and rule.action is Action.BANNED and "BCEWithLogitsLoss" in rule.reason
    assert P.lookup("mm", "cpu").action is Action.LOWER  # dtype defaults to torch's autocast dtype


# ---- registrations ---------------------------------------------------------------------------------------


def test_registrations_are_global_and_separate_from_the_frozen_presets() -> None:
    P.register_float_function(torch, "mm")
    P.register_half_function(F, "gelu")
    P.register_promote_function(torch.Tensor, "__matmul__")
    assert P.TORCH.action("mm", "cpu", torch.bfloat16) is Action.LOWER  # preset untouched
    assert P.lookup("mm", "cpu", torch.bfloat16).action is Action.FP32
    assert P.lookup("gelu", "cuda", torch.float16).action is Action.LOWER
    assert P.lookup("matmul", "cpu", torch.bfloat16).action is Action.PROMOTE
    assert [r.op for r in P.registered_rules()] == ["mm", "gelu", "matmul"]
    assert all(r.source is Source.USER for r in P.registered_rules())
    P.register_half_function(torch, "mm")  # re-registration: latest wins
    assert P.lookup("mm", "cpu", torch.bfloat16).action is Action.LOWER
    P.clear_registrations()
    assert P.registered_rules() == ()
    assert P.lookup("gelu", "cuda", torch.float16) is None


def test_register_as_decorator_and_on_user_modules() -> None:
    @P.register_float_function
    def my_loss(a: torch.Tensor) -> torch.Tensor:
        return a.sum()

    assert P.op_name(my_loss) == my_loss.__mixprec_op__
    assert P.lookup(my_loss, "cpu", torch.bfloat16).action is Action.FP32
    assert my_loss(torch.ones(3)).item() == 3.0  # outside a region: a plain call

    lib = types.ModuleType("mylib")
    lib.fused = lambda x: x * 2  # type: ignore[attr-defined]
    P.register_half_function(lib, "fused")
    assert P.lookup("mylib.fused", "cpu", torch.bfloat16).action is Action.LOWER
    assert P.op_name(lib.fused) == "mylib.fused"  # type: ignore[attr-defined]


def test_bad_registrations_name_the_fix() -> None:
    with pytest.raises(PolicyError, match="no attribute 'not_a_function'"):
        P.register_half_function(torch, "not_a_function")
    with pytest.raises(PolicyError, match="needs a function"):
        P.register_float_function(42)


# ---- display and diff ------------------------------------------------------------------------------------


def test_policy_prints_as_a_table() -> None:
    text = P.TORCH.render(width=200)
    assert "cast policy 'torch'" in text
    for header in ("cpu bf16", "cpu fp16", "cuda fp16", "cuda bf16"):
        assert header in text
    line = next(row for row in text.splitlines() if row.startswith("│ binary_cross_entropy "))
    assert "fp32" in line and "banned*" in line and "BCEWithLogitsLoss" in text


def test_diff_lists_exactly_the_changed_cells() -> None:
    assert not P.diff(P.TORCH, P.TORCH)
    changed = P.TORCH.with_fp32("gelu").with_fp32_modules("LayerNorm")
    result = P.diff(P.TORCH, changed)
    assert {(d, dt, op) for d, dt, op, _, _ in result.ops} == {
        ("cpu", torch.bfloat16, "gelu"),
        ("cpu", torch.float16, "gelu"),
        ("cuda", torch.float16, "gelu"),
        ("cuda", torch.bfloat16, "gelu"),
    }
    assert all(a is Action.NATIVE and b is Action.FP32 for *_, a, b in result.ops)
    assert result.settings == (("fp32_modules", (), ("LayerNorm",)),)
    assert "gelu" in result.render()
    native_vs_default = P.diff(P.TORCH_NATIVE, P.TORCH)
    assert [(d, dt, op) for d, dt, op, _, _ in native_vs_default.ops] == [
        ("cpu", torch.float16, "binary_cross_entropy")
    ]


# ---- bad input ------------------------------------------------------------------------------------------


def test_bad_lookups_name_the_fix() -> None:
    with pytest.raises(PolicyError, match=r"use one of \['cpu', 'cuda'\]"):
        P.TORCH.action("mm", "tpu", torch.float16)
    with pytest.raises(PolicyError, match="does not support torch.float32"):
        P.TORCH.action("mm", "cpu", torch.float32)
    with pytest.raises(PolicyError, match="floating torch dtypes"):
        OpRule("mm", Action.LOWER, dtypes=(torch.int8,))
    with pytest.raises(PolicyError, match="use one of"):
        P.get_preset("O1")
    with pytest.raises(PolicyError, match="keep_fp32"):
        P.TORCH.with_fp32_modules(42)  # type: ignore[arg-type]


def test_every_with_action_spelling_is_with_action() -> None:
    # issue 13: one derivation mechanism; the per-action spellings are that mechanism, not copies.
    for action in Action:
        spelled = getattr(P.TORCH, f"with_{action.value}")("gelu", device_type="cpu", reason="r")
        assert spelled == P.TORCH.with_action(action, "gelu", device_type="cpu", reason="r")
        assert spelled.action("gelu", "cpu", torch.bfloat16) is action
        assert spelled.rule("gelu", "cpu", torch.bfloat16).source is Source.USER


# ---- layout ---------------------------------------------------------------------------------------------

ENGINE_MODULES = (
    "mixprec.autocast", "mixprec.activation_checkpoint", "mixprec.cast_cache", "mixprec.cast_handlers",
    "mixprec.cast_plan", "mixprec.emulation", "mixprec.fp32_modules", "mixprec.half_compute",
    "mixprec.region", "mixprec.tensor_args",
)  # fmt: skip


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    nodes: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        nodes.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return nodes


def _imports(path: Path, package: str) -> set[str]:
    """Every mixprec module ``path`` imports at run time, at any depth of its code (lazy imports too)."""
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith(package)}


def test_the_policy_package_and_the_engine_import_no_cycle() -> None:
    # issue 13: the policy is data the engine reads; nothing in mixprec.policy imports the engine, and
    # the engine's modules import one another in one direction only.
    root = Path(P.__file__).parents[1]
    modules = {
        ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): path
        for path in root.rglob("*.py")
    }
    ours = {m for m in modules if m.startswith("mixprec.policy")} | set(ENGINE_MODULES)
    graph = {m: _imports(modules[m], "mixprec") & set(modules) for m in ours}
    for module in (m for m in ours if m.startswith("mixprec.policy")):
        assert not graph[module] & set(ENGINE_MODULES), (module, graph[module] & set(ENGINE_MODULES))

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, set()) - {"mixprec.policy"}:  # the package facade re-exports only
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = [m for m in ours if m != "mixprec.policy" and reaches(m, m, {m})]
    assert not cycles


def test_compile_key_names_one_live_policy() -> None:
    """Compiled code names a policy by its compile_key (torch.compile before 2.13 cannot pass the frozen
    dataclass itself): each instance, copies and derived policies included, has its own, and only live
    policies are found."""
    derived = P.TORCH.with_fp32("gelu")
    copies = [copy.deepcopy(P.TORCH), pickle.loads(pickle.dumps(P.TORCH)), derived]
    keys = {p.compile_key for p in (P.TORCH, P.APEX, *copies)}
    assert len(keys) == 5 and "" not in keys
    for p in (P.TORCH, *copies):
        assert P.Policy.from_compile_key(p.compile_key) is p
    assert copies[0] == P.TORCH  # the key takes no part in equality
    gone = derived.compile_key
    del derived, copies, p
    gc.collect()
    with pytest.raises(KeyError):
        P.Policy.from_compile_key(gone)


def test_a_rule_for_an_op_torch_calls_from_cpp_is_refused() -> None:
    """A user trial: with_fp32("mkldnn_rnn_layer"), the name in the CPU table, was accepted and changed
    nothing (nn.LSTM calls it from C++ inside lstm); the error names what to write instead."""
    from mixprec.policy.presets import DEFAULT_POLICY

    for op in ("mkldnn_rnn_layer", "cudnn_convolution"):
        with pytest.raises(PolicyError, match=rf"rule for '{op}' would never act"):
            DEFAULT_POLICY.with_fp32(op)
    assert DEFAULT_POLICY.with_fp32("lstm").rule("lstm", "cpu", torch.bfloat16).action is Action.FP32
