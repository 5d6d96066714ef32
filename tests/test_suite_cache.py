"""The suite's persistent XLA compilation cache (tests/conftest.py): wired into jax, and kept under its bound."""

import os

import jax

import conftest


def test_compiles_go_to_the_cache_folder_unless_off():
    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if os.environ.get("JSPARSE_TEST_XLA_CACHE") == "off" and folder is None:
        assert jax.config.jax_compilation_cache_dir is None
        return
    assert folder and jax.config.jax_compilation_cache_dir == folder
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    assert jax.config.jax_compilation_cache_max_size == -1  # no per-write folder scan (conftest's comment)


def test_trim_cache_deletes_the_oldest_files_down_to_half(tmp_path):
    for i in range(10):
        p = tmp_path / f"entry{i}"
        p.write_bytes(b"x" * 100)
        os.utime(p, (1000 + i, 1000 + i))  # entry0 oldest
    assert conftest.trim_cache(tmp_path, 1000) == 0  # 1000 bytes: at the bound, nothing deleted
    assert len(list(tmp_path.iterdir())) == 10
    assert conftest.trim_cache(tmp_path, 900) == 6  # over: down to 450 bytes, oldest first
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"entry{i}" for i in range(6, 10)]
    assert conftest.trim_cache(tmp_path / "missing", 10) == 0
