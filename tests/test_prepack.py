"""CPU weight prepacking (mmspec/models/prepack.py): the packed view computes what the model
computes (float32 rounding), never modifies the model, follows in-place weight changes,
keeps gradients on the real weights, and greedy speculative decoding through packed float32
models still equals the original model's plain greedy `generate`."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import ModelDrafter
from mmspec.models.hf_target import HFTarget
from mmspec.models.prepack import PackedLinear, packed_model, prepack_available, should_prepack

from conftest import left_padded, noisy_copy, tiny_llama, tiny_llava_config

pytestmark = pytest.mark.skipif(not prepack_available(), reason="torch built without oneDNN")

V = 64


@pytest.fixture(scope="module")
def llama32():
    return tiny_llama(layers=2, seed=7, vocab=V, hidden=48, dtype=torch.float32)


def test_view_matches_and_leaves_model_alone(llama32):
    view = packed_model(llama32)
    assert view is packed_model(llama32)  # cached per model
    assert all(type(m) is not PackedLinear for m in llama32.modules())  # the model is untouched
    packed = [m for m in view.modules() if isinstance(m, PackedLinear)]
    linears = [m for m in llama32.modules() if type(m) is torch.nn.Linear]
    assert len(packed) == len(linears) > 0
    assert view.lm_head.weight is llama32.lm_head.weight  # parameters are shared, not copied
    ids = torch.randint(3, V, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = llama32(input_ids=ids).logits
        got = view(input_ids=ids).logits
    scale = ref.abs().max()
    assert torch.allclose(got, ref, rtol=0, atol=1e-5 * scale), (got - ref).abs().max()


def test_in_place_weight_change_is_followed(llama32):
    model = tiny_llama(layers=1, seed=3, vocab=V, hidden=48, dtype=torch.float32)
    view = packed_model(model)
    ids = torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = view(input_ids=ids).logits
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
        model.lm_head.weight.add_(0.5)
        ref = model(input_ids=ids).logits
        after = view(input_ids=ids).logits
    assert not torch.allclose(before, ref, atol=1e-3)  # the change matters ...
    assert torch.allclose(after, ref, rtol=0, atol=1e-5 * ref.abs().max())  # ... and the view follows it


def test_gradients_reach_the_real_weights(llama32):
    lin = torch.nn.Linear(8, 5)
    packed = PackedLinear(lin)
    x = torch.randn(3, 8)
    packed(x).sum().backward()
    assert lin.weight.grad is not None and torch.allclose(lin.weight.grad, x.sum(0).expand(5, 8))


def test_should_prepack_rules(llama32):
    from mmspec.models.kernel_choice import measure

    assert should_prepack(llama32, "auto") is measure(llama32)["prepack"]  # measured on this machine
    assert should_prepack(llama32, False) is False
    f64 = tiny_llama(layers=1, dtype=torch.float64)
    assert should_prepack(f64, "auto") is False  # exactness tests run in float64: never packed
    with pytest.raises(ValueError, match="prepack=True.*float64"):
        should_prepack(f64, True)
    with pytest.raises(ValueError, match="prepack must be"):
        should_prepack(llama32, "yes")
    for number in (0, 1, 1.0):  # equal to False / True, but 0 used to run as "auto" (packing)
        with pytest.raises(ValueError, match="prepack must be"):
            should_prepack(llama32, number)
    with pytest.raises(ValueError, match="prepack"):
        HFTarget(f64, prepack=True)
    with pytest.raises(ValueError, match="prepack"):
        ModelDrafter(f64, 3, prepack="sometimes")
    hooked = tiny_llama(layers=1, dtype=torch.float32)
    hooked.model.layers[0].mlp._hf_hook = object()  # how accelerate marks a dispatched module
    with pytest.raises(ValueError, match="accelerate hooks"):
        should_prepack(hooked, True)
    assert should_prepack(hooked, "auto") is False


def test_packed_greedy_equals_plain_generate(llama32):
    drafter = noisy_copy(llama32, 0.3)
    ids, mask = left_padded([9, 5, 7, 3], vocab=V, seed=11)
    N = 16
    ref = llama32.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=N,
                           min_new_tokens=N, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    # Float32 kernels round differently; the comparison is meaningful only if no greedy step
    # of the reference is a near-tie. Checked, not assumed.
    top2 = torch.stack(ref.scores, 1).topk(2, -1).values
    assert float((top2[..., 0] - top2[..., 1]).min()) > 1e-3
    target = HFTarget(llama32, prepack=True)
    assert isinstance(target.runner.spec.model.lm_head, PackedLinear)
    for draft_model, tree in ((drafter, None), (drafter, mmspec.TreeConfig(depth=3, top_k=2, num_nodes=6))):
        d = (ModelDrafter(draft_model, tree=tree, prepack=True) if tree else ModelDrafter(draft_model, 3, prepack=True))
        out = mmspec.speculative_generate(target, d, ids, mask, temperature=0, max_new_tokens=N, pad_token_id=0)
        assert torch.equal(out.sequences, ref.sequences), (out.sequences[:, 9:], ref.sequences[:, 9:])
        assert out.stats.mean_accepted_length > 1.0


def test_vlm_view_matches():
    """The view is built generically from the module tree: a LLaVA (vision tower, projector,
    language model) computes the same logits through it."""
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(0)
    cfg = tiny_llava_config(V, 60)
    model = LlavaForConditionalGeneration(cfg).eval()
    view = packed_model(model)
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert sum(isinstance(m, PackedLinear) for m in view.modules()) == n_linear > 10
    ids = torch.randint(3, 50, (2, 9), generator=torch.Generator().manual_seed(2))
    ids[:, 1:5] = 60  # 2x2 patches -> 4 image tokens per row
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(input_ids=ids, pixel_values=pixels).logits
        got = view(input_ids=ids, pixel_values=pixels).logits
    assert torch.allclose(got, ref, rtol=0, atol=1e-5 * ref.abs().max()), (got - ref).abs().max()


# ---- the cached view never goes stale ----------------------------------------------------------

def _llama32(seed=3, dropout=0.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attention_dropout=dropout, attn_implementation="eager",
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharper logits, like a trained LM: no near-ties in greedy checks
    return model


def _hook_on_layer(m):
    return m.model.layers[0].mlp.register_forward_hook(lambda mod, args, out: out * 3.0 + 0.1)


def _hook_on_root(m):
    def hook(mod, args, out):
        out.logits = out.logits * -1.0
    return m.register_forward_hook(hook)


def _hook_on_lm_head(m):
    shift = torch.linspace(-2, 2, V)
    return m.lm_head.register_forward_hook(lambda mod, args, out: out + shift)


def _replace_lm_head(m):
    torch.manual_seed(99)
    m.lm_head = torch.nn.Linear(48, V, bias=False)
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)


def _resize(m):
    torch.manual_seed(98)
    m.resize_token_embeddings(V + 8)


def _assign_state(m):
    m.load_state_dict(_llama32(seed=11).state_dict(), assign=True)


def _monkeypatch_act(m):
    m.model.layers[1].mlp.act_fn = torch.nn.Tanh()


STALE_CASES = {
    "hook-added-on-layer": _hook_on_layer,
    "hook-added-on-linear": _hook_on_lm_head,
    "hook-added-on-root": _hook_on_root,
    "lm_head-replaced": _replace_lm_head,
    "resize_token_embeddings": _resize,
    "load_state_dict-assign": _assign_state,
    "submodule-swapped": _monkeypatch_act,
}


@pytest.mark.parametrize("change", list(STALE_CASES.values()), ids=list(STALE_CASES))
def test_view_follows_structural_changes(change):
    """First use builds and caches the view; after the model changes, the view handed out
    computes what the model now computes (and the change matters)."""
    model = _llama32()
    ids = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        packed_model(model)(input_ids=ids)  # first use
        view = packed_model(model)
        change(model)
        ref = model(input_ids=ids).logits
        got = packed_model(model)(input_ids=ids).logits
        again = view(input_ids=ids).logits  # a runner holding the old view object sees the change too
    assert ref.shape != before.shape or not torch.allclose(ref, before, atol=1e-2)  # the change matters
    assert got.shape == ref.shape and torch.allclose(got, ref, rtol=0, atol=1e-5 * ref.abs().max()), (got - ref).abs().max()
    assert torch.allclose(again, ref, rtol=0, atol=1e-5 * ref.abs().max())


def test_removed_hook_and_refresh_of_a_held_view():
    from mmspec.models.prepack import refresh

    model = _llama32()
    ids = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        handle = _hook_on_layer(model)
        view = packed_model(model)  # built with the hook
        hooked = model(input_ids=ids).logits
        assert torch.allclose(view(input_ids=ids).logits, hooked, rtol=0, atol=1e-5 * hooked.abs().max())
        handle.remove()
        assert refresh(view) is view  # in place: runners keep their object
        got = view(input_ids=ids).logits
    assert not torch.allclose(hooked, plain, atol=1e-2)
    assert torch.allclose(got, plain, rtol=0, atol=1e-5 * plain.abs().max())
    assert refresh(model) is model  # not a view: returned as is


def test_eval_after_a_train_mode_call_turns_dropout_off():
    model = _llama32(dropout=0.5).train()
    ids = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        a, b = (packed_model(model)(input_ids=ids).logits for _ in range(2))
        assert not torch.allclose(a, b, atol=1e-3)  # train mode: dropout is on (first call)
        model.eval()
        ref = model(input_ids=ids).logits
        got = packed_model(model)(input_ids=ids).logits
    assert torch.allclose(got, ref, rtol=0, atol=1e-5 * ref.abs().max())


@pytest.mark.parametrize("change", [_hook_on_lm_head, _replace_lm_head, _assign_state],
                         ids=["hook-on-lm_head", "lm_head-replaced", "load_state_dict-assign"])
def test_speculative_greedy_equals_generate_after_the_model_changed(change):
    """End to end: a first speculative_generate call caches the view; after the change the
    next call still equals the model's own greedy generate."""
    model = _llama32(seed=5)
    drafter = noisy_copy(model, 0.3)
    ids, mask = left_padded([6, 4, 5], vocab=V, seed=12)
    N = 10
    mmspec.speculative_generate(model, ModelDrafter(drafter, 3), ids, mask, temperature=0, max_new_tokens=N, pad_token_id=0)
    change(model)
    ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=N, min_new_tokens=N,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    top2 = torch.stack(ref.scores, 1).topk(2, -1).values
    assert float((top2[..., 0] - top2[..., 1]).min()) > 1e-3  # no near-tie: float32 comparison is meaningful
    out = mmspec.speculative_generate(model, ModelDrafter(drafter, 3), ids, mask, temperature=0, max_new_tokens=N,
                                      pad_token_id=0)
    assert torch.equal(out.sequences, ref.sequences), (out.sequences[:, 6:], ref.sequences[:, 6:])


def test_unchanged_model_keeps_its_view_and_packed_weights():
    model = _llama32()
    view = packed_model(model)
    packed = {id(m): m._packed for m in view.modules() if isinstance(m, PackedLinear)}
    assert packed_model(model) is view
    assert {id(m): m._packed for m in view.modules() if isinstance(m, PackedLinear)} == packed  # nothing rebuilt
    model.model.layers[0].register_forward_pre_hook(lambda mod, args: None)
    assert packed_model(model) is view  # rebuilt in place ...
    kept = [m._packed for m in view.modules() if isinstance(m, PackedLinear)]
    assert all(any(k is p for p in packed.values()) for k in kept)  # ... reusing the packed weights


def test_view_does_not_keep_its_model_alive():
    import gc
    import weakref

    from mmspec.models import prepack

    model = _llama32()
    view = packed_model(model)
    alive = weakref.ref(model)
    assert prepack._views_of(model)
    del model, view
    gc.collect()
    assert alive() is None  # the views are kept on the model; nothing module-level holds either


def test_a_model_whose_hooks_refer_to_it_is_freed_with_its_views():
    """The views were kept in a weak dict keyed by model; a view copies the model's hooks and
    attributes, so a hook closing over the model (or `model.orig = model.forward`) made the
    dict's value hold its own key: the model and its packed weights were never freed."""
    import copy
    import gc
    import pickle
    import weakref

    from mmspec.models import prepack

    for how in ("hook", "attribute"):
        model = _llama32()
        if how == "hook":
            model.register_forward_hook(lambda mod, args, out, model=model: out)
        else:
            model.orig_forward = model.forward
        view = packed_model(model)
        assert view is not model and packed_model(model) is view
        clone = copy.deepcopy(model)  # neither a deep copy nor a pickle carries the packed copies
        assert prepack._views_of(clone) == {} and packed_model(clone) is not view
        if how == "attribute":  # a pickled model carries an empty plain dict, which is never taken for views
            loaded = pickle.loads(pickle.dumps(model))
            assert loaded.__dict__[prepack._HOLDER] == {} and prepack._views_of(loaded) == {}
            assert packed_model(loaded) is not view
        alive = weakref.ref(model)
        del model, view, clone
        gc.collect()
        assert alive() is None, how


def test_auto_kernels_follow_the_measurement(monkeypatch):
    """'auto' packs when the packed kernel measures faster and not otherwise (timings faked
    so the decision logic is tested deterministically), and caches per model."""
    from mmspec.models import kernel_choice

    calls = []

    def fake_time(fn, reps, slower):
        calls.append(1)
        name = getattr(fn, "__qualname__", "")
        return 2.0 if ("packed" in name) == slower else 1.0

    for slower, expected in [(True, False), (False, True)]:
        model = tiny_llama(layers=1, dtype=torch.float32)
        monkeypatch.setattr(kernel_choice, "_time", lambda fn, reps, slower=slower: fake_time(fn, reps, slower))
        assert should_prepack(model, "auto") is expected
        n = len(calls)
        assert should_prepack(model, "auto") is expected and len(calls) == n  # cached
        assert HFTarget(model).kernels == ("prepacked" if expected else "stock")


def test_a_reused_target_follows_model_changes_between_calls(llama32):
    """HFTarget / ModelDrafter built once and reused: a hook added to the model after the
    first call is honoured by the next one (the packed view is refreshed per request)."""
    import copy

    model = copy.deepcopy(llama32)
    target = HFTarget(model, prepack=True)
    drafter = ModelDrafter(model, 3, prepack=True)
    ids, mask = left_padded([5, 4], vocab=V, seed=3)
    first = mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=6)
    forced = 7  # a hook that makes token 7 win every step
    handle = model.lm_head.register_forward_hook(lambda m, a, out: out.index_add(
        -1, torch.tensor([forced]), torch.full(out.shape[:-1] + (1,), 1e3, dtype=out.dtype)))
    try:
        second = mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=6)
    finally:
        handle.remove()
    assert (first.sequences[:, ids.shape[1]:] != forced).any()
    assert (second.sequences[:, ids.shape[1]:] == forced).all()


def test_kernel_policy_picks_the_nearest_measured_row_count():
    from mmspec.models.kernel_choice import KernelPolicy

    pol = KernelPolicy((1, 2, 8, 32), (False, True, True, False))
    # log-nearest: 5 -> 8, 16 -> tie between 8 and 32 -> the smaller, 20 -> 32
    want = {1: False, 2: True, 3: True, 5: True, 8: True, 16: True, 20: False, 32: False, 500: False}
    assert {m: pol.use_packed(m) for m in want} == want
    for m in range(1, 3000):  # every prefill shape of a server: the memo stays at the measured range
        pol.use_packed(m)
    assert len(pol._memo) < pol.rows[-1]
    assert pol.uniform is None and pol.describe().startswith("mixed by rows (stock at 1, prepacked at 2")
    assert KernelPolicy((1, 8), (True, True)).describe() == "prepacked"
    assert KernelPolicy((1, 8), (False, False)).uniform is False
    with pytest.raises(ValueError, match="rows"):
        KernelPolicy((8, 1), (True, False))


def _timed_rows(fn) -> int:
    """The row count a `kernel_choice.measure` pass (`stock_call` / `packed_call`) runs at, read
    from the inputs its closure holds: lets a faked `_time` answer per row count."""
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    return next(iter(cells["inputs"].values())).shape[0]


def test_auto_kernels_measure_sixteen_rows(monkeypatch):
    """A kernel that wins only at 16 rows (the stock cliff measured on a Xeon VM: stock jumped
    ~40% from 12 to 16 rows) is found by the measurement and used for 12-22 rows, not inferred
    from 8 and 32."""
    from mmspec.models import kernel_choice

    def fake_time(fn, reps):
        m = _timed_rows(fn)
        if "packed" in fn.__qualname__:
            return 1.0
        return 1.5 if m == 16 else 0.9  # stock wins everywhere but at 16 rows

    monkeypatch.setattr(kernel_choice, "_time", fake_time)
    model = tiny_llama(layers=1, seed=6, vocab=V, hidden=48, dtype=torch.float32)
    result = kernel_choice.measure(model)
    assert 16 in result["rows"]
    policy = result["policy"]
    assert [policy.use_packed(m) for m in (1, 8, 12, 16, 22, 32)] == [False, False, True, True, True, False]


def test_packed_linear_follows_its_policy():
    """Rows the policy sends to stock go through F.linear itself (bit-identical); the others
    through the packed kernel (float32 rounding)."""
    import torch.nn.functional as F

    from mmspec.models.kernel_choice import KernelPolicy

    lin = torch.nn.Linear(64, 48)
    seen = []

    class Spy(KernelPolicy):
        __slots__ = ()

        def use_packed(self, m):
            seen.append(m)
            return super().use_packed(m)

    packed = PackedLinear(lin, policy=Spy((1, 8), (False, True)))
    with torch.no_grad():
        for shape in ((1, 64), (1, 1, 64), (2, 4, 64), (8, 64)):
            x = torch.randn(*shape)
            got, ref = packed(x), F.linear(x, lin.weight, lin.bias)
            if x.numel() // 64 == 1:
                assert torch.equal(got, ref)
            else:
                assert torch.allclose(got, ref, rtol=0, atol=1e-5)
    assert seen == [1, 1, 8, 8]


def test_auto_kernels_mixed_by_row_count(monkeypatch):
    """When the packed kernel measures faster only at some row counts, 'auto' builds the view
    with that policy, says so in `kernels`, and greedy decoding still equals plain generate."""
    from mmspec.models import kernel_choice

    def fake_time(fn, reps):
        name = getattr(fn, "__qualname__", "")
        m = _timed_rows(fn)  # the row count this pass runs at
        return (2.0 if m == 1 else 1.0) if "packed" in name else 1.5  # packed loses at 1 row, wins at more

    monkeypatch.setattr(kernel_choice, "_time", fake_time)
    model = tiny_llama(layers=1, seed=5, vocab=V, hidden=48, dtype=torch.float32)
    target = HFTarget(model)
    assert target.kernels.startswith("mixed by rows (stock at 1, prepacked at 2")
    view = target.runner.spec.model
    assert all(m.policy is not None for m in view.modules() if isinstance(m, PackedLinear))
    assert HFTarget(model, prepack=True).kernels == "prepacked"  # True: packed at every row count
    assert HFTarget(model).kernels.startswith("mixed")  # and "auto" restores the measured policy
    ids, mask = left_padded([6, 4], vocab=V, seed=2)
    ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=10, min_new_tokens=10,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    top2 = torch.stack(ref.scores, 1).topk(2, -1).values
    assert float((top2[..., 0] - top2[..., 1]).min()) > 1e-3  # no near-tie for float32 rounding to flip
    out = mmspec.speculative_generate(target, ModelDrafter(noisy_copy(model, 0.3), 3, prepack=False), ids, mask,
                                      temperature=0, max_new_tokens=10, pad_token_id=0)
    assert torch.equal(out.sequences, ref.sequences)


def _mixed_timing(monkeypatch):
    """Fake kernel timings: packed loses at 1 row and wins at more (a mixed policy)."""
    from mmspec.models import kernel_choice

    def fake_time(fn, reps):
        m = _timed_rows(fn)
        return (2.0 if m == 1 else 1.0) if "packed" in fn.__qualname__ else 1.5

    monkeypatch.setattr(kernel_choice, "_time", fake_time)


def _count_packed_calls(monkeypatch) -> list:
    calls = []
    forward = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: calls.append(x.numel() // self.in_features)
                        or forward(self, x))
    return calls


def test_forwards_at_stock_row_counts_run_the_model_itself(monkeypatch):
    """Under a mixed policy a forward (and the LM head) at a row count that takes the stock
    kernel runs the model itself, not the view's packed linears (each would only check the
    policy and call the stock kernel); larger forwards run the view. Logits are unchanged."""
    from mmspec.models.prepack import for_rows, mixed_source
    from mmspec.types import FeatureRequest

    _mixed_timing(monkeypatch)
    model = tiny_llama(layers=1, seed=5, vocab=V, hidden=48, dtype=torch.float32)
    target = HFTarget(model)
    view = target.runner.spec.model
    assert view is not model and mixed_source(view) is model
    assert for_rows(view, 1) is model and for_rows(view, 2) is view
    assert for_rows(model, 1) is model and mixed_source(model) is None  # not a view: itself
    packed = HFTarget(model, prepack=True).runner.spec.model  # True: its own view, packed at every row count
    assert packed is not view and mixed_source(packed) is None and for_rows(packed, 1) is packed
    assert mixed_source(view) is model and for_rows(view, 1) is model  # the "auto" wrap keeps its policy
    target = HFTarget(model)  # "auto" again: the measured (mixed) policy
    calls = _count_packed_calls(monkeypatch)
    ids, mask = left_padded([5], vocab=V, seed=3)
    with torch.no_grad():
        target.prefill(ids, mask, {}, 8, 4, FeatureRequest(last_hidden=True))
        calls.clear()
        one = target.verify(ids[:, -1:], None)
        assert calls == []  # one row: the model's own stock linears
        four = target.verify(ids[:, -4:], None)
        assert calls and set(calls) == {4}  # four rows: the packed view
        ref = model(input_ids=torch.cat([ids, ids[:, -1:], ids[:, -4:]], 1)).logits[0]  # what the verifies see
        hidden = torch.randn(1, 1, 48)
        calls.clear()
        spec = target.runner.spec
        assert torch.equal(spec.head(hidden), model.lm_head(hidden)) and calls == []
        assert torch.allclose(spec.head(hidden.expand(1, 4, 48)), model.lm_head(hidden.expand(1, 4, 48)), atol=1e-5)
        assert calls == [4]
    assert one.logits.shape == (1, 1, V) and four.logits.shape == (1, 4, V)
    assert torch.allclose(one.logits[0, -1], ref[5], atol=1e-4)  # nothing committed: each verify follows the prompt
    ref4 = model(input_ids=torch.cat([ids, ids[:, -4:]], 1)).logits[0, -4:]
    assert torch.allclose(four.logits[0], ref4, atol=1e-4)


def test_llamagen_target_kernels(monkeypatch):
    """The LlamaGen GPT spec runs measured kernels too: prepacked greedy tokens equal the
    stock ones (float32), a mixed policy sends one-row steps to the GPT itself, and
    prepack=True on a float64 GPT is refused with the reason."""
    from _llamagen_helpers import LABELS, tiny_gpt
    from mmspec.drafters import JacobiDrafter
    from mmspec.models.llamagen_spec import LlamaGenSpec, llamagen_target

    gpt = tiny_gpt(3, dtype=torch.float32)
    run = lambda target: mmspec.speculative_generate(  # noqa: E731
        target, JacobiDrafter(4, vocab_size=gpt.args.vocab_size), LABELS.view(-1, 1), temperature=0,
        max_new_tokens=12)
    stock, packed = llamagen_target(gpt, 2.0, prepack=False), llamagen_target(gpt, 2.0, prepack=True)
    assert (stock.kernels, packed.kernels) == ("stock", "prepacked")
    a, b = run(stock), run(packed)
    assert torch.equal(a.sequences, b.sequences) and b.stats.kernels.startswith("target prepacked")
    with pytest.raises(ValueError, match="float64"):
        LlamaGenSpec(tiny_gpt(3), prepack=True)
    _mixed_timing(monkeypatch)
    from mmspec.models import kernel_choice

    kernel_choice._CACHE.clear()
    target = llamagen_target(gpt, 1.0)  # no CFG: a one-token step of one row is one row
    assert target.kernels.startswith("mixed by rows (stock at 1")
    calls = _count_packed_calls(monkeypatch)
    out = mmspec.speculative_generate(target, JacobiDrafter(4, vocab_size=gpt.args.vocab_size),
                                      LABELS[:1].view(1, 1), temperature=0, max_new_tokens=12)
    assert calls and 1 not in calls  # verifies of 5 tokens packed, the one-row prefill on the GPT itself
    assert torch.equal(out.sequences, run(llamagen_target(gpt, 1.0, prepack=False)).sequences[:1])


def test_data_edits_are_followed_after_repack():
    """Edits through p.data (an EMA's copy_, weight surgery) bypass the version counter the view
    checks: documented, and `repack(model)` makes the view follow them."""
    from mmspec.models.prepack import repack

    model = tiny_llama(layers=1, seed=4, vocab=V, hidden=48, dtype=torch.float32)
    view = packed_model(model)
    ids = torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        view(input_ids=ids)
        for p in model.parameters():
            p.data.mul_(1.5)
        ref = model(input_ids=ids).logits
        stale = view(input_ids=ids).logits
        repack(model)
        after = view(input_ids=ids).logits
    assert not torch.allclose(stale, ref, atol=1e-3)  # what the docstring now says: not seen by itself
    assert torch.allclose(after, ref, rtol=0, atol=1e-5 * ref.abs().max())


def test_linears_carrying_other_state_run_their_own_forward():
    """weight_norm / spectral_norm / LoRA-style Linears lost their state in a PackedLinear, whose
    copied hooks then failed (AttributeError 'weight_g'), even under the default prepack="auto"
    (the measurement packed them); the measurement also ran the model's hooks on random inputs."""
    from mmspec.models.prepack import packable

    model = tiny_llama(layers=1, seed=5, vocab=V, hidden=48, dtype=torch.float32)
    mlp = model.model.layers[0].mlp
    mlp.up_proj = torch.nn.utils.weight_norm(mlp.up_proj)
    mlp.down_proj = torch.nn.utils.spectral_norm(mlp.down_proj)
    lora = model.model.layers[0].self_attn.q_proj
    lora.lora_B = torch.nn.Parameter(torch.randn(lora.out_features, 2) * 0.1)
    lora.lora_A = torch.nn.Parameter(torch.randn(2, lora.in_features) * 0.1)
    lora.register_forward_hook(lambda m, inp, out: out + inp[0] @ m.lora_A.T @ m.lora_B.T)
    assert not any(packable(m) for m in (mlp.up_proj, mlp.down_proj, lora)) and packable(mlp.gate_proj)
    calls = []
    model.lm_head.register_forward_hook(lambda m, inp, out: calls.append(inp[0].shape))
    model.eval()
    ids, mask = left_padded([6, 4], vocab=V)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8, pad_token_id=0,
                             eos_token_id=None)
    for prepack in ("auto", True):
        calls.clear()
        target = HFTarget(model, prepack=prepack)
        assert calls == []  # the measurement no longer runs the model's hooks
        out = mmspec.speculative_generate(target, ModelDrafter(noisy_copy(model, 0.2), 3), ids, mask, temperature=0,
                                          max_new_tokens=8)
        assert torch.equal(out.sequences, ref)
