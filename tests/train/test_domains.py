"""The fine-tuning experiment's two domains (`k31jax.train._domains`): what they read, how they
split, and the one-line refusal when the base domain's files are not on this machine."""

import hashlib
import json
import platform
import sysconfig

import pytest
from pydoc_data.topics import topics

from k31jax.generate import embedded_model_dir
from k31jax.train import embedded_heldout_domain, language_reference_domain


def test_language_reference_domain_splits_every_topic_once(tmp_path):
    domain = language_reference_domain(tmp_path)
    assert set(domain.train_documents) | set(domain.heldout_documents) == set(topics)
    assert not set(domain.train_documents) & set(domain.heldout_documents)
    assert all(int(hashlib.sha256(t.encode()).hexdigest(), 16) % 5 == 0 for t in domain.heldout_documents)
    assert 0.1 < len(domain.heldout_documents) / len(topics) < 0.35
    name = domain.heldout_documents[0]
    assert (domain.heldout / f"{name}.txt").read_text(encoding="utf-8") == topics[name]
    assert len(list(domain.train.iterdir())) == len(domain.train_documents)
    assert language_reference_domain(tmp_path / "again").sha256 == domain.sha256


def test_embedded_heldout_domain_checks_the_bytes(tmp_path, monkeypatch):
    corpus = json.loads((embedded_model_dir() / "corpus.json").read_text())
    if platform.python_version() == corpus["python"]:  # the model's own standard library: every file there
        domain = embedded_heldout_domain(tmp_path / "here")
        assert domain.heldout_documents == tuple(row["path"] for row in corpus["heldout"])
        assert len(list(domain.heldout.iterdir())) == len(domain.heldout_documents)
        assert domain.name.endswith(f"({len(corpus['heldout'])} of {len(corpus['heldout'])} files, "
                                    f"{len(corpus['heldout'])} with the recorded bytes)")
    empty = tmp_path / "no-stdlib"
    empty.mkdir()
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(empty)})
    with pytest.raises(ValueError, match=f"{empty}: none of the embedded model's .* is there"):
        embedded_heldout_domain(tmp_path / "there")
