"""The pieces of per-process local directories that need no second process: a local step is good with its own
record and the completion marker; a replica step is complete only once every process's share and record are in,
and a process writes its record only when the coordinator's answer (here a stand-in callable) says all shares are."""

import json

from openhosti_jax.checkpoint.checksums import (
    COMPLETE_MARKER,
    load_records,
    locally_complete,
    record_checksums,
    record_name,
    verify_checksums,
)
from openhosti_jax.checkpoint.local import mark_complete, resumable_steps, unrecorded_files
from openhosti_jax.checkpoint.replicate import replica_steps, replicate_files


def _process_folder(root, process: int, files: dict[str, bytes]):
    """A step folder as process ``process`` of 2 leaves it: its files, its record, Orbax's own top-level file."""
    step = root / "5"
    for rel, data in files.items():
        (step / rel).parent.mkdir(parents=True, exist_ok=True)
        (step / rel).write_bytes(data)
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    record_checksums(step, sorted(files), process=process, process_count=2)
    return step


def test_a_local_step_is_good_with_its_own_record_and_the_marker(tmp_path):
    step = _process_folder(tmp_path, 1, {"state/w/1.0": b"abcd", "state/array_metadatas/process_1": b"{}"})
    assert not locally_complete(step)
    assert load_records(step)[1] == [f"checksum records of {step} are incomplete: ['{record_name(1, 2)}']"]
    mark_complete(step, 1, 2)
    assert locally_complete(step) and load_records(step)[1] == [] and verify_checksums(step) == []
    assert unrecorded_files(step) == ["_CHECKPOINT_METADATA"]
    (step / record_name(1, 2)).unlink()
    assert not locally_complete(step)  # the marker alone is not enough


def test_a_replica_step_completes_only_with_every_share_committed(tmp_path):
    p0 = _process_folder(tmp_path / "h0", 0, {"state/w/0.0": b"ab", "meta/metadata": b"{}"})
    p1 = _process_folder(tmp_path / "h1", 1, {"state/w/1.0": b"cd", "state/w/0.0": b"ab"})
    replica = tmp_path / "replica"
    # process 1's upload failed: the coordinator says so and no one writes a record
    assert not replicate_files(p0, replica, ["state/w/0.0", "meta/metadata"], process=0, process_count=2,
                               before_commit=lambda uploaded: False)  # fmt: skip
    assert not (replica / "5" / record_name(0, 2)).exists() and replica_steps(replica) == []
    assert replicate_files(p0, replica, ["state/w/0.0", "meta/metadata"], process=0, process_count=2,
                           unrecorded=unrecorded_files(p0))  # fmt: skip
    assert replica_steps(replica) == []  # process 1's share is not in yet
    assert replicate_files(p1, replica, ["state/w/1.0"], process=1, process_count=2)  # 0.0 is process 0's share
    assert replica_steps(replica) == [5]
    assert verify_checksums(replica / "5") == []  # the records together cover exactly the merged files
    assert json.loads((replica / "5" / record_name(1, 2)).read_text())["files"].keys() == {"state/w/1.0"}
    assert (replica / "5" / "_CHECKPOINT_METADATA").exists() and not (replica / "5" / COMPLETE_MARKER).exists()
    # a re-copy deletes this process's old record before uploading: the step is not complete meanwhile
    seen = []
    replicate_files(p1, replica, ["state/w/1.0"], process=1, process_count=2,
                    before_commit=lambda ok: seen.append(replica_steps(replica)) or ok)  # fmt: skip
    assert seen == [[]] and replica_steps(replica) == [5]


def test_resumable_steps_on_one_process():
    assert resumable_steps([2, 4], [4, 6]) == ([6, 4, 2], [4, 6])
