"""Values and inputs the converter must not take silently: NaN / Inf in the weights (counted,
listed, refused with --strict), a --dtype that changes the values (refused, or caught by
--verify), malformed config fields and safetensors headers. Each case: exit code, one error
line naming the field / tensor / file, SRC untouched, nothing published, no temp tree."""

import json
import shutil
import struct

import pytest

from helpers.faults import assert_clean, one_error, run, run_bare, run_with_output, tree_digest
from helpers.model import tiny_config
from k31jax.ckpt import SafetensorsIndex, load_checkpoint
from k31jax.ckpt import convert, write_synthetic_release

NORM = "language_model.model.layers.2.input_layernorm.weight"
EMBED = "language_model.model.embed_tokens.weight"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    cfg = tiny_config(expert_weights="mxfp4", dtype="bfloat16")
    return write_synthetic_release(tmp_path_factory.mktemp("release") / "release", cfg, seed=1, num_shards=3)


@pytest.fixture
def src(release, tmp_path):
    return shutil.copytree(release, tmp_path / "src")


def poke(src, name, index, raw16):
    """Overwrite element `index` of the bf16 tensor `name` with the bit pattern `raw16`."""
    info = SafetensorsIndex(src).tensors[name]
    assert info.dtype == "BF16"
    with open(info.file, "r+b") as f:
        f.seek(info.start + 2 * index)
        f.write(struct.pack("<H", raw16))
    return info


NAN, INF, NEG_INF = 0x7FC1, 0x7F80, 0xFF80


# ---- NaN / Inf ----

def test_nonfinite_values_are_counted_and_listed(src, capsys):
    norm = poke(src, NORM, 3, NAN)
    poke(src, NORM, 5, INF)
    embed = poke(src, EMBED, 100, NEG_INF)
    before = tree_digest(src)
    code, out, err = run_with_output(capsys, "convert", src, src.parent / "ck")
    assert code == 0
    assert sorted(err) == sorted([
        f"k31jax convert: warning: non-finite values in {embed.file.name}: tensor {EMBED!r}: 1 Inf",
        f"k31jax convert: warning: non-finite values in {norm.file.name}: tensor {NORM!r}: 1 NaN, 1 Inf"])
    assert out.splitlines() == [f"converted {src} -> {src.parent / 'ck'}: 1,512 tensors, "
                                f"{len(json.loads((src.parent / 'ck' / 'k31jax_manifest.json').read_text())['files'])} "
                                "files with checksums; non-finite values: 3 in 2 tensors (listed on stderr)"]
    assert tree_digest(src) == before
    result = convert(src, src.parent / "ck2", progress=False)
    assert {(f.tensor, f.nan, f.inf) for f in result.nonfinite} == {(NORM, 1, 1), (EMBED, 0, 1)}


def test_clean_release_reports_none(src, capsys):
    code, out, err = run_with_output(capsys, "convert", src, src.parent / "ck", "--verify")
    assert (code, err) == (0, [])
    assert out.rstrip().endswith("non-finite values: none; verified against the source")


def test_strict_refuses_nonfinite_values(src, capsys):
    norm = poke(src, NORM, 7, NAN)
    before = tree_digest(src)
    code, err = run(capsys, "convert", src, src.parent / "ck", "--strict")
    assert code == 1
    one_error(err, "convert", f"--strict: non-finite values in the source: {norm.file.name}: tensor {NORM!r}: 1 NaN",
              "nothing was published")
    assert tree_digest(src) == before
    assert_clean(src.parent, {"src"})


def test_strict_with_experts_decoded_to_bf16(src, capsys):
    """The decoding path (float expert leaves) is checked the same way."""
    poke(src, EMBED, 0, INF)
    code, err = run(capsys, "convert", src, src.parent / "ck", "--strict", "--expert-weights", "bf16")
    assert code == 1
    one_error(err, "convert", f"tensor {EMBED!r}: 1 Inf")
    assert_clean(src.parent, {"src"})


# ---- --dtype ----

@pytest.mark.parametrize("dtype", ["int8", "uint8", "float8_e4m3fn", "bool", "nonsense"])
def test_dtype_must_be_a_float_that_holds_the_values(src, dtype, capsys):
    code, err = run_bare(capsys, "convert", src, src.parent / "ck", "--dtype", dtype)
    assert code == 2
    one_error(err, "convert", f"argument --dtype: invalid choice: {dtype!r}")
    assert_clean(src.parent, {"src"})


def test_library_dtype_int8_is_refused(src):
    from k31jax.ckpt import CheckpointError

    with pytest.raises(CheckpointError, match="dtype='int8': the non-expert weights can be stored as bfloat16, "
                                              "float16, float32 only"):
        convert(src, src.parent / "ck", dtype="int8", progress=False)
    assert_clean(src.parent, {"src"})


def test_verify_fails_when_the_dtype_changes_a_value(src, capsys):
    """The random release holds bf16 values below float16's normal range (~1e-6): stored as
    float16 they round, and --verify names the first leaf, file and tensor where that happens."""
    before = tree_digest(src)
    code, err = run(capsys, "convert", src, src.parent / "ck", "--dtype", "float16", "--verify")
    assert code == 1
    line = one_error(err, "convert", "--verify: stored leaf layers/", f"does not reproduce {src}/model-",
                     ".safetensors: tensor 'language_model.model.layers.",
                     "stored as float16 from bfloat16: the stored dtype changes its values; first difference at "
                     "element ")
    assert line.split("source ")[1].split(",")[0] != line.split("stored ")[-1]
    assert tree_digest(src) == before
    assert_clean(src.parent, {"src"})


def test_verify_passes_a_widening_dtype(src, capsys):
    assert run(capsys, "convert", src, src.parent / "ck", "--dtype", "float32", "--verify") == (0, [])
    assert load_checkpoint(src.parent / "ck", verify=True).config.num_hidden_layers == 13


# ---- config fields ----

@pytest.mark.parametrize("value, expected", [
    ("thirteen", "num_hidden_layers: expected an integer in [1, 4096], got 'thirteen' (str)"),
    (None, "num_hidden_layers: expected an integer in [1, 4096], got null"),
    (13.7, "num_hidden_layers: expected an integer in [1, 4096], got 13.7 (float)"),
    (1e9, "num_hidden_layers: expected an integer in [1, 4096], got 1000000000.0 (float)"),
    (10 ** 9, "num_hidden_layers: 1000000000 is outside [1, 4096]"),
    (True, "num_hidden_layers: expected an integer in [1, 4096], got True (bool)"),
], ids=["str", "null", "fraction", "float-1e9", "int-1e9", "bool"])
def test_bad_num_hidden_layers(src, value, expected, capsys):
    raw = json.loads((src / "config.json").read_text())
    raw["text_config"]["num_hidden_layers"] = value
    (src / "config.json").write_text(json.dumps(raw))
    before = tree_digest(src)
    code, err = run(capsys, "convert", src, src.parent / "ck")
    assert code == 1
    one_error(err, "convert", f"{src / 'config.json'}: {expected}")
    assert tree_digest(src) == before
    assert_clean(src.parent, {"src"})


@pytest.mark.parametrize("edit, expected", [
    (lambda t: t.update(rms_norm_eps="1e-5"), "rms_norm_eps: expected a finite number, got '1e-5' (str)"),
    (lambda t: t.update(routed_scaling_factor=float("inf")), "routed_scaling_factor: expected a finite number, "
                                                               "got inf (float)"),
    (lambda t: t.update(moe_renormalize="false"), "moe_renormalize: expected true or false, got 'false' (str)"),
    (lambda t: t.update(hidden_size=1 << 30), "hidden_size: 1073741824 is outside [1, 131072]"),
    (lambda t: t["linear_attn_config"].update(num_heads=4.0), "linear_attn_config.num_heads: expected an integer"),
    (lambda t: t["linear_attn_config"].update(kda_layers=["1"]), "linear_attn_config.kda_layers: expected a list "
                                                                 "of 1-indexed layer numbers"),
], ids=["eps-str", "scale-inf", "bool-str", "huge", "heads-float", "layers-str"])
def test_bad_config_fields(src, edit, expected, capsys):
    raw = json.loads((src / "config.json").read_text())
    edit(raw["text_config"])
    (src / "config.json").write_text(json.dumps(raw))
    code, err = run(capsys, "convert", src, src.parent / "ck")
    assert code == 1
    one_error(err, "convert", expected)
    assert_clean(src.parent, {"src"})


@pytest.mark.parametrize("content, expected", [
    (b"[1, 2]", "expected a JSON object (the config fields), got a list"),
    (b'{"vocab_size": "\xff"}', "not UTF-8 text"),
], ids=["list", "not-utf8"])
def test_config_file_that_is_not_an_object(src, content, expected, capsys):
    (src / "config.json").write_bytes(content)
    code, err = run(capsys, "convert", src, src.parent / "ck")
    assert code == 1
    one_error(err, "convert", f"{src / 'config.json'}: {expected}")
    assert_clean(src.parent, {"src"})


def test_info_names_the_bad_field_of_a_config_file(src, capsys):
    raw = json.loads((src / "config.json").read_text())
    raw["text_config"]["num_experts"] = "16"
    (src / "config.json").write_text(json.dumps(raw))
    code, err = run_bare(capsys, "info", "--config", src / "config.json")
    assert code == 1
    one_error(err, "info", "num_experts: expected an integer in [0, 65536], got '16' (str)")


# ---- safetensors headers and index ----

def _rewrite_header(path, edit):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _first_tensor(header):
    return next(k for k in header if k != "__metadata__")


@pytest.mark.parametrize("edit, expected", [
    (lambda h: h[_first_tensor(h)]["shape"].__setitem__(0, float("inf")), "has a malformed header entry"),
    (lambda h: h[_first_tensor(h)]["shape"].__setitem__(0, 64.0), "has a malformed header entry"),
    (lambda h: h.__setitem__("__metadata__", {"format": 5}), "__metadata__ must map strings to strings"),
    (lambda h: h.__setitem__("__metadata__", [1]), "__metadata__ must map strings to strings"),
], ids=["inf-shape", "float-shape", "meta-int", "meta-list"])
def test_malformed_safetensors_header(src, edit, expected, capsys):
    shard = sorted(src.glob("*.safetensors"))[0]
    _rewrite_header(shard, edit)
    code, err = run(capsys, "convert", src, src.parent / "ck")
    assert code == 1
    one_error(err, "convert", f"{shard}: ", expected)
    assert_clean(src.parent, {"src"})


def test_weight_map_with_a_non_string_value(src, capsys):
    index = src / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    name = sorted(raw["weight_map"])[0]
    raw["weight_map"][name] = 5
    index.write_text(json.dumps(raw))
    code, err = run(capsys, "convert", src, src.parent / "ck")
    assert code == 1
    one_error(err, "convert", f"{index}: not a valid index (weight_map maps {name!r} to 5, expected a shard file name)")
    assert_clean(src.parent, {"src"})
