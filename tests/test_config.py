"""Config parsing and the MPI-mismatch logic of _ext, without MPI."""

import pytest

from hybridpipe import _ext
from hybridpipe.config import Config, parse_bytes
from hybridpipe.errors import HybridPipeError


@pytest.mark.parametrize("text, value", [("4194304", 4 << 20), ("4MiB", 4 << 20), ("256KiB", 256 << 10),
                                         ("64mb", 64_000_000), (" 2 GiB ", 2 << 30), ("7", 7)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-4", "4 parsecs", "1.5MiB"])
def test_parse_bytes_rejects_with_the_value_and_an_example(text):
    with pytest.raises(HybridPipeError, match=rf"X={text!r} is not a byte count \(use e.g. 4194304, 4MiB"):
        parse_bytes(text, "X")


def test_from_env_reads_every_setting_and_keeps_defaults():
    config = Config.from_env({"HYBRIDPIPE_FUSION_THRESHOLD": "8MiB", "HYBRIDPIPE_SEGMENT_BYTES": "1MiB",
                              "HYBRIDPIPE_RECEIVE_WINDOW": "3", "HYBRIDPIPE_SMALL_MESSAGE_BYTES": "16KiB",
                              "HYBRIDPIPE_CYCLE_TIME_MS": "2.5", "HYBRIDPIPE_STALL_CHECK_SECONDS": "30",
                              "HYBRIDPIPE_TIMELINE": "/tmp/t.json"})
    assert config == Config(fusion_threshold_bytes=8 << 20, segment_bytes=1 << 20, receive_window=3,
                            small_message_bytes=16 << 10, cycle_time_ms=2.5, stall_check_seconds=30.0,
                            timeline="/tmp/t.json")
    assert Config.from_env({}) == Config()


def test_from_env_names_the_bad_variable():
    with pytest.raises(HybridPipeError, match=r"HYBRIDPIPE_CYCLE_TIME_MS='zero' is not a positive number"):
        Config.from_env({"HYBRIDPIPE_CYCLE_TIME_MS": "zero"})
    with pytest.raises(HybridPipeError, match=r"receive_window=0 must be >= 1"):
        Config.from_env({"HYBRIDPIPE_RECEIVE_WINDOW": "0"})


@pytest.mark.parametrize("text, family", [
    ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution", "Open MPI"),
    ("MPICH Version:      4.2.0\nMPICH Release date: ...", "MPICH"),
    ("Intel(R) MPI Library 2021.10 for Linux* OS", "MPICH"),
    ("MVAPICH2 Version      :\t2.3.7", "MPICH"),
    ("Some Vendor MPI 1.0", "unknown"),
])
def test_mpi_family_detection(text, family):
    assert _ext._family(text) == family


def test_open_mpi_major_version():
    assert _ext._open_mpi_major("Open MPI v4.1.6, package: ...") == "4"
    assert _ext._open_mpi_major("MPICH Version: 4.2.0") == ""


def test_wait_and_engine_priority_settings():
    config = Config.from_env({"HYBRIDPIPE_WAIT_SPIN_US": "-1", "HYBRIDPIPE_WAIT_SLEEP_US": "5",
                              "HYBRIDPIPE_ENGINE_NICE": "0"})
    assert (config.wait_spin_us, config.wait_sleep_us, config.engine_nice) == (-1.0, 5.0, 0)
    assert (Config().wait_spin_us, Config().wait_sleep_us, Config().engine_nice) == (200.0, 200.0, 19)
    with pytest.raises(HybridPipeError, match=r"HYBRIDPIPE_ENGINE_NICE='20' is not a nice increment 0\.\.19"):
        Config.from_env({"HYBRIDPIPE_ENGINE_NICE": "20"})
    with pytest.raises(HybridPipeError, match=r"HYBRIDPIPE_WAIT_SPIN_US='soon' is not a number of microseconds"):
        Config.from_env({"HYBRIDPIPE_WAIT_SPIN_US": "soon"})
    assert Config.from_env({"HYBRIDPIPE_UNFUSED_BYTES": "1MiB"}).unfused_bytes == 1 << 20
    assert Config().unfused_bytes == 256 << 10
    assert Config().waiters_help and not Config.from_env({"HYBRIDPIPE_WAITERS_HELP": "0"}).waiters_help
    with pytest.raises(HybridPipeError, match=r"HYBRIDPIPE_WAITERS_HELP='maybe' is not a switch \(use 1 or 0\)"):
        Config.from_env({"HYBRIDPIPE_WAITERS_HELP": "maybe"})
    with pytest.raises(HybridPipeError, match=r"engine_nice=-3 must be in 0\.\.19"):
        Config(engine_nice=-3).validated()


def test_shared_memory_settings():
    config = Config.from_env({"HYBRIDPIPE_SHARED_MEMORY": "0", "HYBRIDPIPE_SHARED_MEMORY_CHUNK": "256KiB"})
    assert (config.shared_memory, config.shared_memory_chunk_bytes) == (False, 256 << 10)
    assert (Config().shared_memory, Config().shared_memory_chunk_bytes) == (True, 128 << 10)
    with pytest.raises(HybridPipeError, match=r"HYBRIDPIPE_SHARED_MEMORY='maybe' is not a switch \(use 1 or 0\)"):
        Config.from_env({"HYBRIDPIPE_SHARED_MEMORY": "maybe"})
    with pytest.raises(HybridPipeError, match=r"shared_memory_chunk_bytes=100 must be >= 4096 \(e.g. 128KiB\)"):
        Config.from_env({"HYBRIDPIPE_SHARED_MEMORY_CHUNK": "100"})


def test_hierarchical_chunk_setting():
    assert Config.from_env({"HYBRIDPIPE_HIERARCHICAL_CHUNK": "1MiB"}).hierarchical_chunk_bytes == 1 << 20
    assert Config.from_env({"HYBRIDPIPE_HIERARCHICAL_CHUNK": "0"}).hierarchical_chunk_bytes == 0  # one chunk
    with pytest.raises(HybridPipeError, match=r"hierarchical_chunk_bytes=-1 must be >= 0"):
        Config(hierarchical_chunk_bytes=-1).validated()
