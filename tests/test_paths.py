"""Datasets are found through KVSERVE_DATA alone, with an error naming the setting and the flag."""
from __future__ import annotations

import pytest

from kvserve.compress.quant.calibrate import calibration_path
from kvserve.paths import DATA_ENV
from kvserve.tools.bench.serve import default_wikitext_path
from kvserve.tools.eval.ppl import dataset_path


def test_the_setting_locates_wikitext2(monkeypatch, tmp_path):
    (tmp_path / "wikitext2").mkdir()
    for name in ("wiki.test.raw", "wiki.valid.tokens"):
        (tmp_path / "wikitext2" / name).write_text("text\n")
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    assert dataset_path() == default_wikitext_path() == tmp_path / "wikitext2" / "wiki.test.raw"
    assert calibration_path() == tmp_path / "wikitext2" / "wiki.valid.tokens"


@pytest.mark.parametrize("value, message", [(None, "KVSERVE_DATA is not set"), ("/no/such/dir", "no such folder"),
                                            ("EMPTY", "not found")])
def test_missing_data_is_a_clear_error(monkeypatch, tmp_path, value, message):
    if value is None:
        monkeypatch.delenv(DATA_ENV, raising=False)
    else:
        monkeypatch.setenv(DATA_ENV, str(tmp_path) if value == "EMPTY" else value)
    for find, flag in ((dataset_path, "--text-file"), (calibration_path, "--calib-file"),
                       (default_wikitext_path, "--dataset-path")):
        with pytest.raises(ValueError, match=message) as e:
            find()
        assert flag in str(e.value) and DATA_ENV in str(e.value)
