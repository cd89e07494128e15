"""Damaged checkpoints: the checksum manifest written by `k31jax convert` catches a flipped byte
in any stored file (`k31jax verify`, `load_checkpoint(verify=True)`), a truncated or missing
file on every load (sizes), and `export` refuses a damaged checkpoint before writing anything.
`verify --source` checks the round trip to the release tensors."""

import json
import os
import shutil

import pytest

from helpers.faults import assert_clean, one_error, run, run_with_output, tree_digest
from helpers.model import tiny_config
from k31jax.ckpt import IntegrityError, load_checkpoint
from k31jax.ckpt._manifest import MANIFEST_FILE, hash_file
from k31jax.ckpt import convert, verify_checkpoint, write_synthetic_release


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    cfg = tiny_config(expert_weights="mxfp4", dtype="bfloat16")
    return write_synthetic_release(tmp_path_factory.mktemp("release") / "release", cfg, seed=1, num_shards=3)


@pytest.fixture(scope="module")
def checkpoint(release, tmp_path_factory):
    return convert(release, tmp_path_factory.mktemp("ckpt") / "ck", progress=False).dst


@pytest.fixture
def ckpt(checkpoint, tmp_path):
    return shutil.copytree(checkpoint, tmp_path / "ckpt")


def manifest_of(ckpt):
    return json.loads((ckpt / MANIFEST_FILE).read_text())


def flip(path, offset=None):
    """Flip one bit of one byte in the middle of `path` (or at `offset`); returns the offset."""
    size = path.stat().st_size
    offset = size // 2 if offset is None else offset
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x04]))
    return offset


def test_manifest_lists_every_stored_file_with_size_and_checksum(checkpoint):
    m = manifest_of(checkpoint)
    assert m["format"] == "k31jax.manifest/1" and m["hash"] == "xxh3_128"
    on_disk = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())
    assert sorted(m["files"]) == [f for f in on_disk if f != MANIFEST_FILE]
    assert any(f.startswith("state/") and "/d/" in f for f in m["files"])  # the array data files
    for rel, (size, digest) in m["files"].items():
        assert hash_file(checkpoint / rel) == (size, digest), rel


def test_verify_an_intact_checkpoint_and_its_round_trip(checkpoint, release, capsys):
    before = tree_digest(checkpoint)
    code, out, err = run_with_output(capsys, "verify", checkpoint, "--source", release)
    assert (code, err) == (0, [])
    files = manifest_of(checkpoint)["files"]
    total = sum(size for size, _ in files.values()) / 1e6
    assert out.splitlines() == [f"verified {checkpoint}: {len(files)} files, {total:.2f} MB match the manifest "
                                f"(xxh3_128); 1,512 tensors of {release} reproduced bytewise"]
    result = verify_checkpoint(checkpoint, release, progress=False)
    assert result.files == len(manifest_of(checkpoint)["files"]) and result.tensors == 1512
    assert tree_digest(checkpoint) == before  # read-only


def test_a_flipped_byte_in_any_stored_file_is_caught(ckpt, capsys):
    """Every file the manifest lists, one at a time: `k31jax verify` exits 1 naming the file,
    `load_checkpoint(verify=True)` raises `IntegrityError` naming it, the file restored after."""
    files = sorted(manifest_of(ckpt)["files"])
    assert len(files) > 10
    for rel in files:
        path = ckpt / rel
        if path.stat().st_size == 0:
            continue  # an empty marker file has no byte to flip (its size is still checked)
        offset = flip(path)
        code, err = run(capsys, "verify", ckpt)
        assert code == 1, rel
        one_error(err, "verify", f"{path}: damaged (xxh3_128 ")
        with pytest.raises(IntegrityError, match=f"{path}: damaged"):
            load_checkpoint(ckpt, verify=True)
        flip(path, offset)  # restore
    assert run(capsys, "verify", ckpt) == (0, [])


def test_a_flipped_data_byte_is_not_noticed_without_verify_but_is_with_it(ckpt):
    """Sizes are checked on every load; the bytes only with verify=True (a full read)."""
    m = manifest_of(ckpt)["files"]
    data = max((rel for rel in m if "/d/" in rel), key=lambda rel: m[rel][0])
    flip(ckpt / data)
    load_checkpoint(ckpt)  # same size: the cheap check passes
    with pytest.raises(IntegrityError, match=f"{ckpt / data}: damaged"):
        load_checkpoint(ckpt, verify=True)


def test_a_truncated_file_fails_every_load(ckpt, capsys):
    m = manifest_of(ckpt)["files"]
    data = max((rel for rel in m if "/d/" in rel), key=lambda rel: m[rel][0])
    size = m[data][0]
    os.truncate(ckpt / data, size - 100)
    with pytest.raises(IntegrityError, match=f"{ckpt / data}: {size - 100:,} bytes, the manifest records {size:,}"):
        load_checkpoint(ckpt)
    code, err = run(capsys, "verify", ckpt)
    assert code == 1
    one_error(err, "verify", str(ckpt / data), "truncated or damaged")


def test_a_missing_file_fails_every_load(ckpt, capsys):
    gone = next(rel for rel in manifest_of(ckpt)["files"] if "/d/" in rel)
    (ckpt / gone).unlink()
    with pytest.raises(IntegrityError, match=f"{ckpt / gone}: missing"):
        load_checkpoint(ckpt)
    code, err = run(capsys, "verify", ckpt)
    assert code == 1
    one_error(err, "verify", f"{ckpt / gone}: missing")


def test_an_unlisted_file_fails_verify(ckpt, capsys):
    (ckpt / "state" / "stray").write_bytes(b"x")
    code, err = run(capsys, "verify", ckpt)
    assert code == 1
    one_error(err, "verify", f"{ckpt / 'state' / 'stray'}: not listed in {MANIFEST_FILE}")


def test_a_damaged_or_missing_manifest(ckpt, capsys):
    text = (ckpt / MANIFEST_FILE).read_text()
    (ckpt / MANIFEST_FILE).write_text(text[: len(text) // 2])
    code, err = run(capsys, "verify", ckpt)
    assert code == 1
    one_error(err, "verify", f"{ckpt / MANIFEST_FILE}: damaged manifest")
    with pytest.raises(IntegrityError, match="damaged manifest"):
        load_checkpoint(ckpt)
    (ckpt / MANIFEST_FILE).unlink()
    code, err = run(capsys, "verify", ckpt)
    assert code == 1
    one_error(err, "verify", f"{ckpt / MANIFEST_FILE}: missing, so the stored bytes cannot be checked")
    with pytest.raises(IntegrityError, match="missing"):
        load_checkpoint(ckpt, verify=True)
    assert load_checkpoint(ckpt).config.num_hidden_layers == 13  # an older checkpoint still loads


def test_export_refuses_a_damaged_checkpoint(ckpt, capsys):
    m = manifest_of(ckpt)["files"]
    data = max((rel for rel in m if "/d/" in rel), key=lambda rel: m[rel][0])
    flip(ckpt / data)
    before = tree_digest(ckpt)
    code, err = run(capsys, "export", ckpt, ckpt.parent / "out")
    assert code == 1
    one_error(err, "export", f"{ckpt / data}: damaged", "export refuses a damaged checkpoint (nothing was written)")
    assert tree_digest(ckpt) == before
    assert_clean(ckpt.parent, {"ckpt"})


def test_verify_source_catches_a_different_release(ckpt, release, tmp_path, capsys):
    other = write_synthetic_release(tmp_path / "other", tiny_config(expert_weights="mxfp4", dtype="bfloat16"),
                                    seed=2, num_shards=3)
    code, err = run(capsys, "verify", ckpt, "--source", other)
    assert code == 1
    one_error(err, "verify", "verify --source: stored leaf", f"does not reproduce {other}")


def test_verify_source_must_be_the_same_model(ckpt, tmp_path, capsys):
    other = write_synthetic_release(tmp_path / "other", tiny_config(expert_weights="mxfp4", dtype="bfloat16",
                                                                    num_experts=8), seed=2, num_shards=3)
    code, err = run(capsys, "verify", ckpt, "--source", other)
    assert code == 1
    one_error(err, "verify")


def test_verify_a_folder_that_is_not_a_checkpoint(tmp_path, release, capsys):
    code, err = run(capsys, "verify", tmp_path / "absent")
    assert code == 1
    one_error(err, "verify", f"{tmp_path / 'absent'}: no such checkpoint folder")
    code, err = run(capsys, "verify", release)
    assert code == 1
    one_error(err, "verify", f"{release}: not a k31jax checkpoint", MANIFEST_FILE)
