import asyncio

import numpy as np
import pytest
import uvloop

from dsa_async.errors import ConfigError
from dsa_async.geometry import HostLayout, KvDtype, PageGeometry, dsa_indexer, mla_kv, model_pools


def test_dsa_indexer_matches_deepseek_v32_facts():
    g = dsa_indexer()
    assert g.bytes_per_token_per_layer == 132
    assert g.bytes_per_page_per_layer == 8448
    assert g.bytes_per_page == 515_328
    assert g.num_layers == 61
    assert g.bytes_per_token == 8052


def test_draft_layer_adds_one_layer():
    assert dsa_indexer(with_draft=True).num_layers == 62
    assert mla_kv(with_draft=True).num_layers == 62


@pytest.mark.parametrize("dtype,expected", [(KvDtype.FP8, 656), (KvDtype.BF16, 1152)])
def test_mla_kv_bytes_per_token(dtype, expected):
    assert mla_kv(dtype).bytes_per_token_per_layer == expected


def test_model_pools_share_the_page_size():
    pools = model_pools("deepseek-v3.2", kv_dtype=KvDtype.FP8)
    assert [p.name for p in pools] == ["indexer", "kv"]
    assert {p.page_size_tokens for p in pools} == {64}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(bytes_per_token_per_layer=0),
        dict(bytes_per_token_per_layer=-1),
        dict(bytes_per_token_per_layer=1.5),
        dict(bytes_per_token_per_layer=132, num_layers=0),
        dict(bytes_per_token_per_layer=132, host_layout="layer_first"),
    ],
)
def test_bad_geometry_is_refused(kwargs):
    with pytest.raises(ConfigError):
        PageGeometry(name="x", **kwargs)


def test_unknown_model_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="deepseek-v3.2"):
        model_pools("llama")


# Truthy or falsy but not a yes/no: 'no' is truthy, [] falsy, 2 and 1.0 numbers.
NOT_A_FLAG = ["no", "yes", "", 0, 1, 2, 1.0, [1], [], None, np.int64(1), KvDtype.FP8]
FLAG_TAKERS = {
    "dsa_indexer": lambda flag: dsa_indexer(with_draft=flag),
    "mla_kv": lambda flag: mla_kv(with_draft=flag),
    "model_pools": lambda flag: model_pools("deepseek-v3.2", kv_dtype=KvDtype.FP8,
                                            with_draft=flag),
}


@pytest.mark.parametrize("taker", FLAG_TAKERS)
@pytest.mark.parametrize("bad", NOT_A_FLAG, ids=repr)
def test_with_draft_takes_only_a_bool(taker, bad):
    with pytest.raises(ConfigError, match="with_draft must be True or False, got"):
        FLAG_TAKERS[taker](bad)


@pytest.mark.parametrize("taker", FLAG_TAKERS)
def test_with_draft_takes_python_and_numpy_bools(taker):
    for flag, layers in ((True, 62), (np.True_, 62), (False, 61), (np.False_, 61)):
        pools = FLAG_TAKERS[taker](flag)
        pools = pools if isinstance(pools, tuple) else (pools,)
        assert {type(g.num_layers) for g in pools} == {int}
        assert {g.num_layers for g in pools} == {layers}


def test_layouts_have_user_spellings():
    assert {m.value for m in HostLayout} == {"layer_first", "page_first"}


async def test_suite_runs_on_uvloop():
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
