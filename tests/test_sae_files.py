"""SAEs in SAELens's folder format: save and load, the math against tests/sae_reference.py, and
every malformed folder refused with a message naming it. Fast; no engine."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from salience.core.features import sae as sae_module
from salience.core.features.sae import ARCHITECTURES, check_fits, load_sae, save_sae
from salience.core.models.points import Site, parse_hook
from salience.errors import ModelError
from tests import sae_reference as ref

D_IN, D_SAE, K = 16, 48, 6


def weights(architecture: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {
        "W_enc": torch.randn(D_IN, D_SAE, generator=g) / 2,
        "b_enc": torch.randn(D_SAE, generator=g) / 4,
        "W_dec": torch.randn(D_SAE, D_IN, generator=g) / 4,
        "b_dec": torch.randn(D_IN, generator=g) / 4,
    }
    if architecture == "jumprelu":
        w["threshold"] = torch.rand(D_SAE, generator=g)
    return w


def v6_cfg(architecture: str, **top: Any) -> dict[str, Any]:
    cfg = {"architecture": architecture, "d_in": D_IN, "d_sae": D_SAE, "dtype": "float32", "device": "cpu"}
    cfg |= {"apply_b_dec_to_input": True, "normalize_activations": "none", "reshape_activations": "none"}
    if architecture == "topk":
        cfg["k"] = K
    cfg["metadata"] = {"sae_lens_version": "6.12.0", "hook_name": "blocks.2.hook_resid_post", "hook_head_index": None}
    return cfg | top


def inputs(seed: int = 1) -> torch.Tensor:
    return torch.randn(3, 5, D_IN, generator=torch.Generator().manual_seed(seed))


def assert_matches_reference(folder: Path, sae: sae_module.SparseAutoencoder) -> None:
    reference, x = ref.read_folder(folder), inputs()
    acts = sae.encode(x)
    np.testing.assert_allclose(acts.numpy(), ref.encode(reference, x.numpy()), atol=1e-5, rtol=0)
    np.testing.assert_allclose(sae.decode(acts).numpy(), ref.decode(reference, acts.numpy()), atol=1e-5, rtol=0)
    if sae.architecture == "topk":
        assert (acts != 0).sum(dim=-1).eq(sae.k).all()


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_save_then_load_round_trips(tmp_path: Path, architecture: str) -> None:
    w = weights(architecture)
    folder = tmp_path / "my-sae"
    k = K if architecture == "topk" else None
    extra = {"dataset_path": "corpus", "context_size": 128}
    save_sae(folder, architecture=architecture, layer=5, k=k, model_name="tiny", extra_metadata=extra, **w)

    cfg = json.loads((folder / "cfg.json").read_text())
    assert cfg["architecture"] == architecture and cfg["d_in"] == D_IN and cfg["d_sae"] == D_SAE
    assert (cfg["dtype"], cfg["device"], cfg["normalize_activations"], cfg["reshape_activations"]) == (
        "float32", "cpu", "none", "none",
    )  # fmt: skip
    assert cfg.get("k") == k and cfg["apply_b_dec_to_input"] is True
    assert cfg["metadata"] | {"sae_lens_version": None} == {
        "sae_lens_version": None, "model_name": "tiny", "hook_name": "blocks.5.hook_resid_post",
        "hook_head_index": None, "prepend_bos": True, **extra,
    }  # fmt: skip
    assert ref.sae_lens_version(cfg) >= 6  # else SAELens would read the old layout and drop the metadata
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-sae"]  # no scratch left behind

    sae = load_sae(folder)
    assert (sae.name, sae.folder, sae.architecture, sae.layer) == ("my-sae", folder, architecture, 5)
    assert (sae.hook_name, sae.d_in, sae.d_sae, sae.k) == ("blocks.5.hook_resid_post", D_IN, D_SAE, k)
    for key in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold"):
        loaded = getattr(sae, key)
        if key not in w:
            assert loaded is None
            continue
        assert loaded.dtype == torch.float32 and loaded.is_contiguous()
        assert torch.equal(loaded, w[key])
    assert_matches_reference(folder, sae)
    x = inputs()
    np.testing.assert_allclose(
        sae.pre_activations(x).numpy(), ref.pre_activations(ref.read_folder(folder), x.numpy()), atol=1e-5
    )
    info = sae.info()
    assert json.loads(json.dumps(info)) == info
    assert info == {
        "name": "my-sae", "layer": 5, "d_in": D_IN, "d_sae": D_SAE, "architecture": architecture, "k": k,
        "point": "resid_post", "hook_name": "blocks.5.hook_resid_post", "apply_b_dec_to_input": True,
        "sha256": sae.sha256,
    }  # fmt: skip
    assert len(sae.sha256) == 64 and load_sae(folder, name="other").sha256 == sae.sha256
    assert load_sae(folder, name="other").name == "other"
    moved = sae.to("cpu")
    assert moved is not sae and torch.equal(moved.encode(x), sae.encode(x))


def test_apply_b_dec_to_input_false(tmp_path: Path) -> None:
    save_sae(tmp_path / "s", architecture="standard", layer=0, apply_b_dec_to_input=False, **weights("standard"))
    sae = load_sae(tmp_path / "s")
    assert sae.apply_b_dec_to_input is False
    assert_matches_reference(tmp_path / "s", sae)
    x = inputs()
    assert torch.allclose(sae.pre_activations(x), x @ sae.W_enc + sae.b_enc)


def test_sha256_follows_the_files(tmp_path: Path) -> None:
    save_sae(tmp_path / "a", architecture="standard", layer=1, **weights("standard"))
    save_sae(tmp_path / "b", architecture="standard", layer=2, **weights("standard"))
    save_sae(tmp_path / "c", architecture="standard", layer=1, **weights("standard", seed=9))
    digests = {load_sae(tmp_path / name).sha256 for name in "abc"}
    assert len(digests) == 3


def test_v5_flat_topk_loads(tmp_path: Path) -> None:
    cfg = {
        "architecture": "standard", "d_in": D_IN, "d_sae": D_SAE, "dtype": "float32", "device": "cpu",
        "model_name": "gpt2", "hook_name": "blocks.3.hook_resid_pre", "hook_layer": 3, "hook_head_index": None,
        "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 5}, "apply_b_dec_to_input": False,
        "finetuning_scaling_factor": False, "sae_lens_training_version": "5.5.2", "prepend_bos": True,
        "normalize_activations": "none", "context_size": 128,
    }  # fmt: skip
    folder = ref.write_folder(tmp_path / "v5", cfg, weights("topk") | {"scaling_factor": torch.ones(D_SAE)})
    sae = load_sae(folder)
    assert (sae.architecture, sae.k, sae.site, sae.hook_name) == (
        "topk",
        5,
        Site(3, "resid_pre"),
        "blocks.3.hook_resid_pre",
    )
    assert sae.apply_b_dec_to_input is False
    assert_matches_reference(folder, sae)


def test_oldest_flat_layout_loads(tmp_path: Path) -> None:
    # hook_point, no architecture, a bool normalize_activations: SAELens's own defaults apply.
    cfg = {"d_in": D_IN, "d_sae": D_SAE, "hook_point": "blocks.1.hook_resid_post", "hook_point_layer": 1,
           "activation_fn_str": "relu", "normalize_activations": False, "dtype": "torch.float32"}  # fmt: skip
    folder = ref.write_folder(tmp_path / "old", cfg, weights("standard"))
    sae = load_sae(folder)
    assert (sae.architecture, sae.k, sae.layer, sae.apply_b_dec_to_input) == ("standard", None, 1, True)
    assert_matches_reference(folder, sae)


def test_v5_jumprelu_on_a_hugging_face_module_path(tmp_path: Path) -> None:
    cfg = {"architecture": "jumprelu", "d_in": D_IN, "d_sae": D_SAE, "hook_name": "model.layers.7",
           "activation_fn_str": "relu", "sae_lens_training_version": None}  # fmt: skip
    folder = ref.write_folder(tmp_path / "jr", cfg, weights("jumprelu"))
    sae = load_sae(folder)
    assert (sae.architecture, sae.layer) == ("jumprelu", 7)
    assert_matches_reference(folder, sae)


def test_topk_rescaled_by_decoder_norms_matches_saelens(tmp_path: Path) -> None:
    w = weights("topk")
    w["W_dec"] = w["W_dec"] * torch.linspace(0.2, 3.0, D_SAE)[:, None]  # norms that reorder the top k
    folder = ref.write_folder(tmp_path / "r", v6_cfg("topk", rescale_acts_by_decoder_norm=True), w)
    sae = load_sae(folder)
    assert_matches_reference(folder, sae)
    plain = load_sae(ref.write_folder(tmp_path / "p", v6_cfg("topk"), w))
    assert not torch.equal((sae.encode(inputs()) != 0), (plain.encode(inputs()) != 0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_weights_load_as_float32(tmp_path: Path, dtype: torch.dtype) -> None:
    w = {key: value.to(dtype) for key, value in weights("jumprelu").items()}
    sae = load_sae(ref.write_folder(tmp_path / "h", v6_cfg("jumprelu", dtype=str(dtype)), w))
    for key, value in w.items():
        assert getattr(sae, key).dtype == torch.float32
        assert torch.equal(getattr(sae, key), value.float())


def test_topk_ties_keep_the_lowest_ids(tmp_path: Path) -> None:
    b_enc = torch.tensor([0.5, 2.0, 1.0, 2.0, 2.0, -1.0])
    zeros = {"W_enc": torch.zeros(2, 6), "b_enc": b_enc, "W_dec": torch.ones(6, 2), "b_dec": torch.zeros(2)}
    x = torch.randn(4, 2)
    for k, kept in [(2, [1, 3]), (3, [1, 3, 4]), (4, [1, 2, 3, 4]), (6, [0, 1, 2, 3, 4])]:
        save_sae(tmp_path / f"t{k}", architecture="topk", layer=0, k=k, **zeros)
        acts = load_sae(tmp_path / f"t{k}").encode(x)
        expected = torch.zeros(6)
        expected[kept] = b_enc[kept]
        assert torch.equal(acts, expected.expand(4, 6)), (k, acts)


# --- malformed folders ---------------------------------------------------------------------------

Case = Callable[[dict, dict], tuple[Any, Any]]


def cfg_edit(arch: str = "standard", /, **changes: Any) -> tuple[str, Case]:
    def edit(cfg: dict, w: dict) -> tuple[Any, Any]:
        for key, value in changes.items():
            target, _, field = key.rpartition("__")
            holder = cfg["metadata"] if target == "metadata" else cfg
            if value is DELETE:
                holder.pop(field or key, None)
            else:
                holder[field or key] = value
        return cfg, w

    return arch, edit


def weights_edit(architecture: str, change: Callable[[dict], None]) -> tuple[str, Case]:
    def edit(cfg: dict, w: dict) -> tuple[Any, Any]:
        change(w)
        return cfg, w

    return architecture, edit


def rescaled_with_a_zero_row(cfg: dict, w: dict) -> tuple[Any, Any]:
    w["W_dec"][4] = 0.0
    return cfg | {"rescale_acts_by_decoder_norm": True}, w


DELETE = object()
LEGACY = {"metadata": DELETE, "hook_name": "blocks.2.hook_resid_post"}

MALFORMED: dict[str, tuple[tuple[str, Case], str]] = {
    "no cfg.json": (("standard", lambda c, w: (None, w)), "has no cfg.json"),
    "no weights": (("standard", lambda c, w: (c, None)), "has no sae_weights.safetensors"),
    "invalid json": (("standard", lambda c, w: ("{not json", w)), "cfg.json is not valid JSON"),
    "json list": (("standard", lambda c, w: ("[1, 2]", w)), "cfg.json is not a JSON object"),
    "no d_in": (cfg_edit(d_in=DELETE), "cfg.json has no 'd_in'"),
    "d_sae a string": (cfg_edit(d_sae="48"), "needs 'd_sae' as int, got '48'"),
    "d_in a bool": (cfg_edit(d_in=True), "needs 'd_in' as int"),
    "d_sae zero": (cfg_edit(d_sae=0), "must be positive"),
    "metadata a list": (cfg_edit(metadata=[1]), "'metadata' is not an object"),
    "no architecture": (cfg_edit(architecture=DELETE), "cfg.json has no 'architecture'"),
    "gated": (cfg_edit(architecture="gated"), "'gated' is not supported (supported: standard, topk, jumprelu)"),
    "crosscoder": (cfg_edit(architecture="crosscoder"), "'crosscoder' is not supported"),
    "layer_norm": (cfg_edit(normalize_activations="layer_norm"), "normalize_activations 'layer_norm' is not supported"),
    "constant_norm_rescale": (cfg_edit(normalize_activations="constant_norm_rescale"), "changes the input per token"),
    "expected_average": (cfg_edit(normalize_activations="expected_average_only_in"), "does not carry"),
    "legacy normalize flag": (cfg_edit(normalize_activations=True, **LEGACY), "'expected_average_only_in' is not"),
    "unknown normalize": (cfg_edit(normalize_activations="whiten"), "not implemented"),
    "hook_z": (cfg_edit(reshape_activations="hook_z"), "reshape_activations 'hook_z'"),
    "head index": (cfg_edit(metadata__hook_head_index=3), "one attention head is not supported"),
    "tanh-relu": (cfg_edit(activation_fn_str="tanh-relu", **LEGACY), "activation function 'tanh-relu' is not"),
    "v5 topk without k": (cfg_edit(activation_fn_str="topk", **LEGACY), "needs an integer k"),
    "topk without k": (cfg_edit("topk", k=DELETE), "needs an integer k with 1 <= k <= d_sae (48), got None"),
    "topk k zero": (cfg_edit("topk", k=0), "got 0"),
    "topk k above d_sae": (cfg_edit("topk", k=D_SAE + 1), "got 49"),
    "topk k a float": (cfg_edit("topk", k=2.5), "got 2.5"),
    "topk contradiction": (cfg_edit(activation_fn="topk"), "contradicts architecture 'standard'"),
    "rescale not a bool": (cfg_edit("topk", rescale_acts_by_decoder_norm="yes"), "'rescale_acts_by_decoder_norm'"),
    "apply_b_dec a string": (cfg_edit(apply_b_dec_to_input="true"), "'apply_b_dec_to_input' as bool"),
    "unknown dtype": (cfg_edit(dtype="int8"), "dtype 'int8' is not one of"),
    "hook_z name": (cfg_edit(metadata__hook_name="blocks.2.attn.hook_z"), "'blocks.2.attn.hook_z' is not a point"),
    "attn module": (cfg_edit(metadata__hook_name="model.layers.2.self_attn"), "is not a point Salience reads"),
    "no hook": (cfg_edit(metadata__hook_name=DELETE), "names no hook"),
    "no W_dec": (weights_edit("standard", lambda w: w.pop("W_dec")), "needs W_dec, missing from"),
    "extra tensor": (
        weights_edit("standard", lambda w: w.update(b_gate=torch.zeros(D_SAE))),
        "unexpected tensors b_gate",
    ),
    "threshold on standard": (
        weights_edit("standard", lambda w: w.update(threshold=torch.zeros(D_SAE))),
        "unexpected tensors threshold in sae_weights.safetensors for a standard SAE",
    ),
    "W_enc transposed": (
        weights_edit("standard", lambda w: w.update(W_enc=w["W_enc"].T.contiguous())),
        "W_enc has shape [48, 16], expected [16, 48]",
    ),
    "b_dec short": (
        weights_edit("standard", lambda w: w.update(b_dec=w["b_dec"][:-1])),
        "b_dec has shape [15], expected [16]",
    ),
    "nan": (weights_edit("standard", lambda w: w["b_enc"].__setitem__(3, float("nan"))), "b_enc has non-finite"),
    "inf": (weights_edit("topk", lambda w: w["W_dec"].__setitem__((1, 2), float("inf"))), "W_dec has non-finite"),
    "float64 beyond float32": (
        weights_edit("standard", lambda w: w.update(b_dec=torch.full((D_IN,), 1e6, dtype=torch.float64) ** 8)),
        "b_dec has non-finite",
    ),
    "int tensor": (
        weights_edit("standard", lambda w: w.update(b_dec=torch.zeros(D_IN, dtype=torch.int32))),
        "not a float tensor",
    ),
    "jumprelu without threshold": (
        weights_edit("jumprelu", lambda w: w.pop("threshold")),
        "a jumprelu SAE needs threshold",
    ),
    "jumprelu log_threshold": (
        weights_edit("jumprelu", lambda w: w.update(log_threshold=w.pop("threshold").log())),
        "log_threshold is a training checkpoint's",
    ),
    "scaling_factor": (
        weights_edit("standard", lambda w: w.update(scaling_factor=torch.full((D_SAE,), 2.0))),
        "scaling_factor other than 1",
    ),
    "garbage weights": (("standard", lambda c, w: (c, b"not a safetensors file")), "cannot read sae_weights"),
    "rescale with a zero row": (("topk", rescaled_with_a_zero_row), "zero W_dec row"),
}  # fmt: skip


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_malformed_folders_are_refused_by_name(tmp_path: Path, case: str) -> None:
    (architecture, edit), expected = MALFORMED[case]
    cfg, w = edit(v6_cfg(architecture), weights(architecture))
    folder = ref.write_folder(tmp_path / "bad", cfg, w)
    with pytest.raises(ModelError) as caught:
        load_sae(folder)
    assert str(folder) in str(caught.value)
    assert expected in str(caught.value)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=f"SAE folder {tmp_path / 'nowhere'} does not exist"):
        load_sae(tmp_path / "nowhere")


# --- fitting a model, hooks -----------------------------------------------------------------------


def test_check_fits(tmp_path: Path) -> None:
    save_sae(tmp_path / "s", architecture="standard", layer=3, **weights("standard"))
    sae = load_sae(tmp_path / "s")
    check_fits(sae, hidden_size=D_IN, num_layers=4)
    with pytest.raises(ModelError, match="SAE s reads d_in 16 but the model's hidden size is 32"):
        check_fits(sae, hidden_size=32, num_layers=4)
    with pytest.raises(ModelError, match=r"SAE s reads layer 3 but the model has layers 0\.\.2"):
        check_fits(sae, hidden_size=D_IN, num_layers=3)


@pytest.mark.parametrize(
    ("hook", "site"),
    [
        ("blocks.0.hook_resid_post", Site(0)),
        ("blocks.11.hook_resid_post", Site(11)),
        ("blocks.0.hook_resid_pre", Site(0, "resid_pre")),
        ("blocks.12.hook_resid_pre", Site(12, "resid_pre")),
        ("blocks.3.hook_resid_mid", Site(3, "resid_mid")),
        ("blocks.3.hook_attn_out", Site(3, "attn_out")),
        ("blocks.3.hook_mlp_out", Site(3, "mlp_out")),
        ("blocks.3.ln2.hook_normalized", Site(3, "mlp_in")),
        ("blocks.2.hook_in", Site(2, "resid_pre")),
        ("blocks.2.ln2.hook_in", Site(2, "resid_mid")),
        ("blocks.2.attn.hook_out", Site(2, "attn_out")),
        ("blocks.2.mlp.hook_in", Site(2, "mlp_in")),
        ("blocks.2.mlp.hook_out", Site(2, "mlp_out")),
        ("blocks.2.hook_out", Site(2)),
        ("model.layers.4", Site(4)),
        ("transformer.h.5", Site(5)),
        ("model.language_model.layers.17", Site(17)),
        ("language_model.model.layers.2", Site(2)),
    ],
)
def test_a_hook_name_is_read_as_its_site(hook: str, site: Site) -> None:
    assert parse_hook(hook) == site


@pytest.mark.parametrize(
    "hook",
    [
        *("blocks.3.attn.hook_z", "blocks.3.attn.hook_pattern", "model.layers.3.mlp", "model.layers.x"),
        *("hook_embed", "blocks.3.hook_resid_post.extra", "blocks.x.hook_resid_pre"),
    ],
)
def test_a_hook_that_is_no_point_is_refused_naming_the_points(hook: str) -> None:
    with pytest.raises(ValueError, match=rf"hook '{re.escape(hook)}' is not a point Salience reads; it reads "):
        parse_hook(hook)


def test_an_sae_at_a_point_its_family_lacks_is_refused_naming_both(tmp_path: Path) -> None:
    from salience.core.models.families import family_of

    save_sae(tmp_path / "s", architecture="standard", layer=2, point="resid_mid", **weights("standard"))
    sae = load_sae(tmp_path / "s")
    assert (sae.site, sae.hook_name, sae.info()["point"]) == (
        Site(2, "resid_mid"),
        "blocks.2.hook_resid_mid",
        "resid_mid",
    )
    check_fits(sae, hidden_size=sae.d_in, num_layers=4, family=family_of(["LlamaForCausalLM"]))
    with pytest.raises(ModelError, match=r"SAE s reads blocks\.2\.hook_resid_mid, but GPT-NeoX models have no hook "):
        check_fits(sae, hidden_size=sae.d_in, num_layers=4, family=family_of(["GPTNeoXForCausalLM"]))


TRANSCODER_HOOKS = {"hook_name": "blocks.2.ln2.hook_normalized", "hook_name_out": "blocks.2.hook_mlp_out"}
D_OUT = 12


def transcoder_folder(folder: Path, kind: str, **cfg_changes: Any) -> Path:
    g = torch.Generator().manual_seed(4)
    w = weights("jumprelu" if kind == "jumprelu_transcoder" else "standard")
    w |= {"W_dec": torch.randn(D_SAE, D_OUT, generator=g) / 4, "b_dec": torch.randn(D_OUT, generator=g) / 4}
    if kind == "skip_transcoder":
        w["W_skip"] = torch.randn(D_OUT, D_IN, generator=g) / 4
    cfg = v6_cfg(kind, d_out=D_OUT) | cfg_changes
    cfg["metadata"] |= TRANSCODER_HOOKS
    return ref.write_folder(folder, cfg, w)


@pytest.mark.parametrize("kind", ["transcoder", "skip_transcoder", "jumprelu_transcoder"])
def test_a_transcoder_reads_the_mlp_input_and_encodes_as_saelens(tmp_path: Path, kind: str) -> None:
    """Its features are read where its hook is (the MLP's normalized input), encoded without b_dec
    (the output's), and its decode plus a skip transcoder's W_skip @ x is SAELens's output."""
    folder = transcoder_folder(tmp_path / kind, kind)
    sae, reference, x = load_sae(folder), ref.read_folder(folder), inputs()
    assert (sae.site, sae.transcoder, sae.hook_name_out, sae.d_out) == (
        *(Site(2, "mlp_in"), kind),
        *("blocks.2.hook_mlp_out", D_OUT),
    )
    assert {key: sae.info()[key] for key in ("point", "transcoder", "hook_name_out", "d_out")} == {
        "point": "mlp_in",
        "transcoder": kind,
        "hook_name_out": "blocks.2.hook_mlp_out",
        "d_out": D_OUT,
    }
    acts = sae.encode(x)
    np.testing.assert_allclose(acts.numpy(), ref.encode(reference, x.numpy()), atol=1e-5, rtol=0)
    assert (acts > 0).any() and (acts == 0).any()
    out = sae.decode(acts) + (x @ sae.W_skip.T if sae.W_skip is not None else 0)
    np.testing.assert_allclose(out.numpy(), ref.transcode(reference, x.numpy()), atol=1e-5, rtol=0)


def test_a_transcoder_without_its_output_hook_or_skip_matrix_is_refused(tmp_path: Path) -> None:
    folder = transcoder_folder(tmp_path / "t", "transcoder")
    cfg = json.loads((folder / "cfg.json").read_text())
    del cfg["metadata"]["hook_name_out"]
    (folder / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelError, match=r"a transcoder names the hook it reconstructs: cfg\.json has no hook_name_out"
    ):
        load_sae(folder)
    skip = transcoder_folder(tmp_path / "s", "skip_transcoder")
    cfg = json.loads((skip / "cfg.json").read_text())
    (tmp_path / "s" / "cfg.json").write_text(json.dumps(cfg | {"architecture": "transcoder"}))
    with pytest.raises(ModelError, match=r"unexpected tensors W_skip in sae_weights\.safetensors for a transcoder SAE"):
        load_sae(skip)
    (tmp_path / "s" / "cfg.json").write_text(json.dumps(cfg | {"d_out": D_IN}))
    with pytest.raises(
        ModelError, match=r"W_dec has shape \[48, 12\], expected \[48, 16\] \(d_in 16, d_sae 48, d_out 16\)"
    ):
        load_sae(skip)


# --- saving ---------------------------------------------------------------------------------------


def test_save_replaces_an_sae_folder(tmp_path: Path) -> None:
    folder = tmp_path / "s"
    save_sae(folder, architecture="standard", layer=1, **weights("standard"))
    (folder / "sparsity.safetensors").write_bytes(b"")
    save_sae(folder, architecture="topk", layer=2, k=3, **weights("topk", seed=4))
    sae = load_sae(folder)
    assert (sae.architecture, sae.layer, sae.k) == ("topk", 2, 3)
    assert torch.equal(sae.W_enc, weights("topk", seed=4)["W_enc"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    assert sorted(p.name for p in folder.iterdir()) == ["cfg.json", "sae_weights.safetensors"]


def test_save_refuses_to_replace_other_folders(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an SAE folder"):
        save_sae(tmp_path, architecture="standard", layer=1, **weights("standard"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_an_interrupted_save_leaves_the_old_folder_or_nothing(tmp_path: Path, monkeypatch) -> None:
    def boom(fd: int) -> None:
        raise OSError("disk full")

    save_sae(tmp_path / "kept", architecture="standard", layer=1, **weights("standard"))
    before = {p.name: p.read_bytes() for p in (tmp_path / "kept").iterdir()}
    monkeypatch.setattr(sae_module.os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        save_sae(tmp_path / "new", architecture="standard", layer=1, **weights("standard"))
    with pytest.raises(OSError, match="disk full"):
        save_sae(tmp_path / "kept", architecture="standard", layer=2, **weights("standard", seed=3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "kept").iterdir()} == before


@pytest.mark.parametrize(
    ("architecture", "changes", "message"),
    [
        ("gated", {}, "'gated' is not one of standard, topk, jumprelu"),
        ("standard", {"k": 4}, "k is given for topk SAEs only"),
        ("topk", {}, "k is given for topk SAEs only"),
        ("jumprelu", {"threshold": None}, "threshold for jumprelu ones only"),
        ("standard", {"threshold": torch.zeros(D_SAE)}, "threshold for jumprelu ones only"),
        ("topk", {"k": D_SAE + 1}, "needs an integer k"),
        ("standard", {"layer": -1}, "layer must be a non-negative int"),
        ("standard", {"W_enc": torch.zeros(D_IN)}, "W_enc must be [d_in, d_sae]"),
        ("standard", {"b_dec": torch.zeros(D_IN + 1)}, "b_dec has shape [17], expected [16]"),
        ("standard", {"b_enc": torch.full((D_SAE,), float("nan"))}, "b_enc has non-finite values"),
        ("standard", {"extra_metadata": {"hook_name": "x"}}, "extra_metadata may not set hook_name"),
    ],
)
def test_save_refuses_bad_arguments(tmp_path: Path, architecture: str, changes: dict, message: str) -> None:
    args = {"layer": 1, **weights(architecture)} | changes
    args = {key: value for key, value in args.items() if value is not None}
    with pytest.raises(ValueError) as caught:
        save_sae(tmp_path / "s", architecture=architecture, **args)
    assert message in str(caught.value)
    assert list(tmp_path.iterdir()) == []
