"""`make test`'s pytest-xdist workers with different CPU device counts, and the files each may run.

A job's programs partitioned over 8 host devices cost up to twice the CPU they cost on one (test_classify_job.py,
test_trainer_options.py and test_predict.py: 88 CPU-s on 1 device, 165 on 8). Most files are not about sharding:
they run on the 1-device workers; the files below build meshes of several devices and run only on a worker that has
them (the 8-device one), which runs nothing else while a 1-device worker is live and then ends.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping

# Test files -> the host devices they need (the rest need one).
FILE_DEVICES = {
    "test_pretrain.py": 8,  # in-process runs equal to 8-device subprocesses; an 8-device checkpoint; "8 cpu device(s)"
    "test_train_step.py": 8,  # data=2 x fsdp=2 x tensor=2, data=4 x tensor=2 meshes
    "test_model.py": 8,  # sharded outputs on (8,1,1), (2,2,2), (1,2,4) meshes
    "test_data_pipeline.py": 8,  # a global batch on a data=4 x fsdp=2 mesh
    "test_dropout_attention.py": 4,  # the fused kernel per shard on data=2 x tensor=2
    "test_layer_norm_gpu.py": 4,  # the GPU LayerNorm kernels per shard on data=2 x tensor=2
    "test_modernbert_sharding.py": 4,  # ModernBERT's feed-forward on data=2 x tensor=2
    "test_dropout.py": 8,  # the same dropout mask when sharded over every device
    "test_embedding.py": 8,  # the ranking loss over an 8-device global batch equals one device's
}
# Not here though they name meshes: test_scan_layers.py (its default tests compare numbers and partition specs, the
# same on one device; its sharded train step is slow-marked) and test_tpu_compile.py (libtpu's compile-only TPU
# devices, not host ones).


def devices_needed(nodeid: str) -> int:
    """The host devices the test file of `nodeid` (a pytest node id or a path) needs."""
    return FILE_DEVICES.get(os.path.basename(nodeid.split("::", 1)[0]), 1)


def next_file(files: Iterable[str], devices: int, fewest: int, most: int) -> str | None:
    """Which of `files` (queue order) a worker with `devices` host devices takes next, where the live workers have
    `fewest` to `most`: a file that only workers like it can run; nothing else while a worker with fewer devices
    is live (the same tests cost it more); else the first it can run. A file that no worker can run goes to whoever
    asks, to fail there (tests/conftest.py) rather than never run. None: nothing for it."""
    runnable = [f for f in files if devices_needed(f) <= devices or devices_needed(f) > most]
    only_here = [f for f in runnable if devices_needed(f) > fewest]
    if only_here:
        return only_here[0]
    return None if devices > fewest or not runnable else runnable[0]


def make_scheduler(config, log, worker_devices: Callable[[Mapping[str, str]], int]):
    """pytest-xdist's `--dist loadfile` scheduler (a file at a time, in collection order), but a file goes only to a
    worker with the host devices it needs, and a worker that nothing is left for is shut down. `worker_devices`: the
    host devices of a worker started with the given `--tx ...//env:NAME=value` settings."""
    from xdist.scheduler import LoadFileScheduling

    class DeviceScheduling(LoadFileScheduling):
        def _devices(self, node) -> int:
            return worker_devices(node.gateway.spec.env)

        def _next_file(self, node) -> str | None:
            live = [self._devices(n) for n in self.nodes if not n.shutting_down] or [self._devices(node)]
            return next_file(self.workqueue, self._devices(node), min(live), max(live))

        def _assign_work_unit(self, node) -> None:
            scope = self._next_file(node)
            if scope is None:
                return
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

        def _reschedule(self, node) -> None:
            if not node.shutting_down and self.workqueue and self._next_file(node) is None:
                node.shutdown()  # what is left needs more devices than it has
                return
            super()._reschedule(node)

        def schedule(self) -> None:
            # With fewer files than workers, xdist shuts down the workers added last: keep the most devices.
            if self.collection is None:
                self.assigned_work = dict(sorted(self.assigned_work.items(), key=lambda item: -self._devices(item[0])))
            super().schedule()

    return DeviceScheduling(config, log)
