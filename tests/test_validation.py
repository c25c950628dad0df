"""Every input path of `target.generate(..., assistant_model=drafter)` refuses what D3D cannot honour (issue 17).

The four kinds of input (`inputs_embeds`, invalid drafter config values, non-integer `input_ids`, `use_cache=False`)
end in a `ValueError` that says what to change, before any forward pass, or give the target's own answer; a
property-based test (hypothesis, derandomised) sends random invalid values of every `D3DConfig` field through every
entry point (`D3DConfig(...)`, `from_dict`, `from_pretrained` keyword overrides, `AutoConfig`, `drafter.config.X = ...`
before `generate`) and checks that each is refused with a `ValueError` that names the field, never a deeper crash.
"""

import copy
import math
import re

import pytest
import torch
from _tiny import random_prompt, tiny_target
from d3d_hf.modeling.configuration_d3d import BUNDLE_VERSION, DEFAULT_BLOCK_LORA_MODULES, validate_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, GenerationConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from d3d_hf import D3DConfig, D3DForDiffusionDrafting


class _ForwardCounter:
    """Counts forward passes of the given modules."""

    def __init__(self, *modules):
        self.calls = 0
        self._handles = [module.register_forward_pre_hook(self._count) for module in modules]

    def _count(self, module, args):
        self.calls += 1

    def remove(self):
        for handle in self._handles:
            handle.remove()


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("llama", seed=3)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    return target, drafter


def _generate(target, drafter, ids=None, **kwargs):
    if ids is not None:
        kwargs.setdefault("attention_mask", torch.ones(ids.shape, dtype=torch.long))
    kwargs.setdefault("max_new_tokens", 8)
    return target.generate(ids, assistant_model=drafter, do_sample=False, **kwargs)


def _refused(target, drafter, match, ids=None, **kwargs):
    """`generate` raises a ValueError matching `match` with no forward pass of the target or the drafter."""
    counter = _ForwardCounter(target, drafter)
    try:
        with pytest.raises(ValueError, match=match):
            _generate(target, drafter, ids, **kwargs)
    finally:
        counter.remove()
    assert counter.calls == 0


# ----------------------------------------------------------------------------------------------------------------------
# the four inputs of the issue


def test_inputs_embeds_with_input_ids_is_refused(pair):
    target, drafter = pair
    ids = random_prompt()
    soft_prompt = target.get_input_embeddings()(ids) + 0.5  # embeddings that are not the ids' own
    _refused(
        target,
        drafter,
        r"does not take `inputs_embeds`.*Pass the prompt as `input_ids`",
        ids,
        inputs_embeds=soft_prompt,
    )


def test_inputs_embeds_alone_is_refused(pair):
    target, drafter = pair
    embeds = target.get_input_embeddings()(random_prompt())
    _refused(target, drafter, r"does not take `inputs_embeds`.*`input_ids`", inputs_embeds=embeds)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.bool, torch.int16, torch.uint8])
def test_non_integer_input_ids_are_refused(pair, dtype):
    target, drafter = pair
    ids = random_prompt().to(dtype)
    _refused(target, drafter, rf"`input_ids` must hold token ids as integers.*got a {dtype}.*input_ids.long\(\)", ids)


def test_int32_input_ids_give_the_target_answer(pair):
    target, drafter = pair
    ids = random_prompt(seed=2)
    alone = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(_generate(target, drafter, ids.to(torch.int32)), alone)


@pytest.mark.parametrize("offset", [-200, 97])
def test_input_ids_outside_the_vocabulary_are_refused(pair, offset):
    target, drafter = pair
    ids = random_prompt()
    ids[0, 3] = offset if offset > 0 else -1
    _refused(target, drafter, r"outside the vocabulary \[0, 97\)", ids)


@pytest.mark.parametrize("where", ["keyword", "generation_config", "target_default"])
def test_use_cache_false_is_refused_naming_the_flag(pair, where):
    target, drafter = pair
    ids = random_prompt()
    kwargs = {}
    if where == "keyword":
        kwargs["use_cache"] = False
    elif where == "generation_config":
        kwargs["generation_config"] = GenerationConfig(use_cache=False, max_new_tokens=8, do_sample=False)
    saved = target.generation_config.use_cache
    if where == "target_default":
        target.generation_config.use_cache = False
    try:
        _refused(
            target,
            drafter,
            r"`use_cache=False` cannot be used with an assistant.*Drop `use_cache=False`",
            ids,
            **kwargs,
        )
    finally:
        target.generation_config.use_cache = saved


def test_valid_inputs_still_decode_losslessly(pair):
    target, drafter = pair
    ids = random_prompt(seed=5)
    alone = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert torch.equal(_generate(target, drafter, ids, max_new_tokens=12, use_cache=True), alone)


# ----------------------------------------------------------------------------------------------------------------------
# drafter config values, at every entry point


def _valid_config_kwargs() -> dict:
    """A small valid config (2 layers, vocabulary 97, as the tiny target), with every optional field set."""
    return dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        mlp_bias=False,
        use_qk_norm=False,
        tie_word_embeddings=False,
        block_size=4,
        mask_token_id=5,
        source_model="tiny",
        source_layer_ids=[0, 1],
        pruned_layer_ids=[0, 2],
        target_model="tiny",
        block_lora_rank=2,
        block_lora_alpha=8.0,
        block_lora_full_layers=1,
        block_lora_modules=["q_proj", "v_proj"],
        shares_target_weights=False,
        shares_target_cache=False,
        reads_target_hidden_state=False,
        draft_vocab_size=50,
        initializer_range=0.02,
        attention_dropout=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


_NOT_NUMBERS = st.one_of(
    st.text(max_size=4), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(), st.none())
)
_NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


def _whole(low: int, optional: bool = False) -> st.SearchStrategy:
    """Values that are not a whole number >= low: smaller ints, floats (even whole ones), bools, strings, lists."""
    wrong = [st.integers(max_value=low - 1), st.floats(allow_nan=True), st.booleans(), _NOT_NUMBERS]
    if not optional:
        wrong.append(st.none())
    return st.one_of(*wrong)


def _real(low: float, inclusive: bool, high: float | None = None) -> st.SearchStrategy:
    below = st.floats(max_value=low, exclude_max=inclusive, allow_nan=False)
    wrong = [below, _NON_FINITE, st.booleans(), st.none(), _NOT_NUMBERS]
    if high is not None:
        wrong.append(st.floats(min_value=high, allow_nan=False, allow_infinity=False))
    return st.one_of(*wrong)


def _not_bool() -> st.SearchStrategy:
    return st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=5), st.none(), st.lists(st.booleans()))


def _layer_ids(distinct: bool) -> st.SearchStrategy:
    wrong = [
        st.lists(st.integers(0, 9), min_size=3, max_size=5),  # the wrong length (2 layers)
        st.lists(st.integers(0, 9), max_size=1),
        st.tuples(st.integers(max_value=-1), st.integers(0, 9)).map(list),  # a negative index
        st.tuples(st.floats(), st.integers(0, 9)).map(list),
        st.tuples(st.text(max_size=2), st.integers(0, 9)).map(list),
        st.text(min_size=1, max_size=4),
        st.integers(),
    ]
    if distinct:
        wrong.append(st.integers(0, 9).map(lambda i: [i, i]))
    return st.one_of(*wrong)


def _rope() -> st.SearchStrategy:
    bad_theta = st.one_of(st.floats(max_value=0.0), _NON_FINITE, st.text(max_size=3), st.none(), st.booleans())
    return st.one_of(
        st.text(max_size=6),
        st.integers(),
        st.lists(st.integers(), max_size=2),
        bad_theta.map(lambda theta: {"rope_type": "default", "rope_theta": theta}),
        st.text(min_size=1, max_size=8)
        .filter(lambda t: t != "default" and t not in ROPE_INIT_FUNCTIONS)
        .map(lambda rope_type: {"rope_type": rope_type, "rope_theta": 10000.0}),
        st.sampled_from(["linear", "dynamic", "yarn", "llama3", "longrope"]).map(
            lambda rope_type: {"rope_type": rope_type, "rope_theta": 10000.0}  # without the keys that type reads
        ),
    )


def _modules() -> st.SearchStrategy:
    return st.one_of(
        st.sampled_from(DEFAULT_BLOCK_LORA_MODULES),  # a bare string, not a list
        st.just([]),
        st.lists(st.text(max_size=6).filter(lambda t: t not in DEFAULT_BLOCK_LORA_MODULES), min_size=1, max_size=3),
        st.sampled_from(DEFAULT_BLOCK_LORA_MODULES).map(lambda m: [m, m]),
        st.lists(st.integers(), min_size=1, max_size=2),
        st.integers(),
    )


#: For each field, values it must refuse (given the other fields of `_valid_config_kwargs`).
INVALID_VALUES = {
    "vocab_size": st.one_of(_whole(1), st.integers(1, 5)),  # 1..5: the mask token id 5 falls outside the vocabulary
    "hidden_size": _whole(1),
    "intermediate_size": _whole(1),
    "num_hidden_layers": _whole(1),
    "num_attention_heads": st.one_of(_whole(1), st.sampled_from([3, 5, 7])),  # not a multiple of the 2 kv heads
    "num_key_value_heads": st.one_of(_whole(1, optional=True), st.sampled_from([3, 5, 8])),  # does not divide 4
    "head_dim": st.one_of(_whole(2, optional=True), st.integers(1, 99).map(lambda i: 2 * i + 1)),  # odd
    "hidden_act": st.one_of(st.text(max_size=6).filter(lambda t: t not in ACT2FN), st.integers(), st.none()),
    "max_position_embeddings": st.one_of(_whole(1), st.integers(1, 3)),  # 1..3: shorter than the block of 4
    "rms_norm_eps": _real(0.0, inclusive=False),
    "rope_parameters": _rope(),
    "attention_bias": _not_bool(),
    "mlp_bias": _not_bool(),
    "use_qk_norm": _not_bool(),
    "tie_word_embeddings": _not_bool(),
    "block_size": st.one_of(_whole(1), st.integers(513, 10**6)),  # longer than the 512-token context
    "mask_token_id": st.one_of(
        st.integers(max_value=-1), st.integers(min_value=97), st.floats(), st.booleans(), _NOT_NUMBERS
    ),
    "source_model": st.one_of(st.integers(), st.floats(), st.lists(st.text(max_size=2), max_size=2)),
    "source_layer_ids": _layer_ids(distinct=False),
    "pruned_layer_ids": _layer_ids(distinct=True),
    "target_model": st.one_of(st.integers(), st.floats(), st.booleans()),
    "block_lora_rank": _whole(0),
    "block_lora_full_layers": st.one_of(_whole(0), st.integers(3, 10**6)),  # more than the 2 layers
    "block_lora_alpha": _real(0.0, inclusive=False),
    "block_lora_modules": _modules(),
    "shares_target_weights": _not_bool(),
    "shares_target_cache": _not_bool(),
    "reads_target_hidden_state": _not_bool(),
    "draft_vocab_size": st.one_of(
        st.integers(max_value=0), st.integers(min_value=98), st.floats(), st.booleans(), _NOT_NUMBERS
    ),  # outside [1, vocab_size = 97]
    "initializer_range": _real(0.0, inclusive=True),
    "attention_dropout": _real(0.0, inclusive=True, high=1.0),
    "bos_token_id": st.one_of(st.floats(), st.text(max_size=3), st.booleans()),
    "eos_token_id": st.one_of(st.floats(), st.text(max_size=3), st.lists(st.text(max_size=2), min_size=1, max_size=2)),
    "pad_token_id": st.one_of(st.floats(), st.text(max_size=3), st.booleans()),
}
FIELD_AND_VALUE = st.sampled_from(sorted(INVALID_VALUES)).flatmap(
    lambda name: st.tuples(st.just(name), INVALID_VALUES[name])
)
VALIDATION_SETTINGS = settings(
    derandomize=True, max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def test_every_field_has_invalid_values():
    """The property tests below cover every field `D3DConfig.__init__` takes."""
    import inspect

    parameters = set(inspect.signature(D3DConfig.__init__).parameters) - {"self", "kwargs"}
    assert parameters == set(INVALID_VALUES) == set(_valid_config_kwargs())


def test_valid_values_are_accepted_everywhere(tmp_path):
    config = D3DConfig(**_valid_config_kwargs())
    validate_config(config)
    again = D3DConfig.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict()
    config.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path, block_size=8).block_size == 8
    # what the defaults stand for: None for the derived fields, a theta next to the rope dict
    derived = D3DConfig(
        num_key_value_heads=None, head_dim=None, rope_parameters={"rope_type": "default"}, rope_theta=5e4
    )
    assert (derived.num_key_value_heads, derived.head_dim, derived.rope_parameters["rope_theta"]) == (9, 64, 5e4)


def _assert_names(err: pytest.ExceptionInfo, name: str) -> None:
    assert f"`{name}`" in str(err.value), str(err.value)


@VALIDATION_SETTINGS
@given(FIELD_AND_VALUE)
def test_property_constructor_and_from_dict_refuse_invalid_values(field_and_value):
    name, value = field_and_value
    kwargs = _valid_config_kwargs()
    with pytest.raises(ValueError) as err:
        D3DConfig(**{**kwargs, name: copy.deepcopy(value)})
    _assert_names(err, name)
    saved = D3DConfig(**kwargs).to_dict()
    with pytest.raises(ValueError) as err:  # a config.json holding the value
        D3DConfig.from_dict({**saved, name: copy.deepcopy(value)})
    _assert_names(err, name)
    with pytest.raises(ValueError) as err:  # a keyword override, set after __init__ by transformers
        D3DConfig.from_dict(dict(saved), **{name: copy.deepcopy(value)})
    _assert_names(err, name)


@pytest.fixture(scope="module")
def saved_drafter(tmp_path_factory):
    """A saved drafter of `_valid_config_kwargs()` (the values `INVALID_VALUES` are invalid against)."""
    drafter = D3DForDiffusionDrafting(D3DConfig(**_valid_config_kwargs()))
    folder = tmp_path_factory.mktemp("drafter")
    drafter.save_pretrained(folder)
    return folder


@VALIDATION_SETTINGS
@given(FIELD_AND_VALUE)
def test_property_from_pretrained_refuses_invalid_overrides(saved_drafter, field_and_value):
    name, value = field_and_value
    for load in (D3DForDiffusionDrafting.from_pretrained, AutoConfig.from_pretrained, D3DConfig.from_pretrained):
        with pytest.raises(ValueError) as err:
            load(saved_drafter, **{name: copy.deepcopy(value)})
        _assert_names(err, name)


@pytest.fixture(scope="module")
def hand_set_pair():
    target = tiny_target("llama", seed=3)
    drafter = D3DForDiffusionDrafting(D3DConfig(**_valid_config_kwargs()))
    return target, drafter


@VALIDATION_SETTINGS
@given(FIELD_AND_VALUE)
def test_property_generate_refuses_fields_set_by_hand(hand_set_pair, field_and_value):
    target, drafter = hand_set_pair
    name, value = field_and_value
    saved = copy.deepcopy(getattr(drafter.config, name))
    setattr(drafter.config, name, copy.deepcopy(value))
    counter = _ForwardCounter(target, drafter)
    try:
        with pytest.raises(ValueError) as err:
            _generate(target, drafter, random_prompt(), max_new_tokens=2)
        _assert_names(err, name)
        assert counter.calls == 0
    finally:
        counter.remove()
        setattr(drafter.config, name, saved)


def test_hand_set_block_size_is_named_before_generate(pair):
    """The case of the issue: `drafter.config.block_size = 0` names `block_size`, not an option the user never set."""
    target, drafter = pair
    for value in (0, -3, "8", 2.5, None):
        drafter.config.block_size = value
        try:
            _refused(target, drafter, r"`block_size` must be a whole number \(int\) >= 1", random_prompt())
        finally:
            drafter.config.block_size = 4


def test_validation_hook_is_idempotent_and_reversible(pair):
    from transformers.generation import GenerationMixin

    from d3d_hf import install_generation_hook, remove_generation_hook

    install_generation_hook()
    wrapped = GenerationMixin._validate_generation_mode
    install_generation_hook()
    assert GenerationMixin._validate_generation_mode is wrapped
    target, drafter = pair
    remove_generation_hook()
    try:
        assert not getattr(GenerationMixin._validate_generation_mode, "_d3d_generation_hook", False)
        assert not getattr(GenerationMixin._get_candidate_generator, "_d3d_generation_hook", False)
        with pytest.raises(RuntimeError, match="Assisted decoding requires a cache"):  # transformers' own error
            _generate(target, drafter, random_prompt(), use_cache=False)
    finally:
        install_generation_hook()
    assert getattr(GenerationMixin._validate_generation_mode, "_d3d_generation_hook", False)
    _refused(target, drafter, "`use_cache=False`", random_prompt(), use_cache=False)


# ----------------------------------------------------------------------------------------------------------------------
# the bundle's version stamp: the installed hook drives only drafters of its own bundle version (issue 36)


def _stamp_refusal(found: str) -> str:
    return (
        rf"{re.escape(found)}.*generate hook installed in this process is bundle version {BUNDLE_VERSION!r}"
        r".*load_drafter\(folder\).*instead of `trust_remote_code=True`.*save_pretrained\(folder\)"
    )


@pytest.mark.parametrize("stamp", [BUNDLE_VERSION + 1, "0.9", None], ids=["newer", "other", "unstamped"])
def test_drafter_of_another_bundle_version_is_refused(pair, monkeypatch, stamp):
    """A drafter whose class carries another stamp (a checkpoint's remote-code copy of another d3d-hf, simulated here
    on the class; tests/test_checkpoint.py loads a real one) or none is refused before any forward pass."""
    target, drafter = pair
    if stamp is None:
        monkeypatch.delattr(D3DForDiffusionDrafting, "_d3d_bundle_version")
    else:
        monkeypatch.setattr(D3DForDiffusionDrafting, "_d3d_bundle_version", stamp)
    found = "no version stamp" if stamp is None else f"version {stamp!r}"
    _refused(target, drafter, _stamp_refusal(found), random_prompt())


def test_candidate_generator_factory_checks_the_stamp_too(pair, monkeypatch):
    """On a transformers whose `_validate_generation_mode` the hook cannot wrap, the factory refuses the drafter."""
    from transformers.generation import GenerationMixin

    target, drafter = pair
    original = GenerationMixin._validate_generation_mode._d3d_original
    monkeypatch.setattr(GenerationMixin, "_validate_generation_mode", original)
    monkeypatch.setattr(D3DForDiffusionDrafting, "_d3d_bundle_version", BUNDLE_VERSION + 1)
    _refused(target, drafter, _stamp_refusal(f"version {BUNDLE_VERSION + 1!r}"), random_prompt())


def test_drafter_of_the_same_bundle_version_decodes_as_the_target():
    target = tiny_target("llama", seed=3)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    assert type(drafter)._d3d_bundle_version == BUNDLE_VERSION
    ids = random_prompt()
    reference = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(_generate(target, drafter, ids, max_new_tokens=12), reference)
    assert drafter.last_generation_stats.rounds > 0


def test_model_constructor_checks_a_config_edited_after_it_was_built():
    config = D3DConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config.block_size = 0
    with pytest.raises(ValueError, match="block_size"):
        D3DForDiffusionDrafting(config)
