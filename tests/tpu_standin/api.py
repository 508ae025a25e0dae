"""The TPU API's v2alpha1 surface that bertjax uses, served on 127.0.0.1 over plaintext gRPC, driven by a script.

Served: queuedResources create / get / delete (long-running operations, polled through
google.longrunning.Operations/GetOperation) and nodes get. Each create takes the next *plan* from the script: the
states the queued resource walks through, one per GetQueuedResource (the last one stays), e.g.
`["WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"]` or `[("FAILED", "There is no more capacity ...")]`.
`preempt(name)` does what a spot preemption does: the queued resource goes SUSPENDING then SUSPENDED, the node
PREEMPTED, and the workers' processes are killed. `fail_next(method, code)` makes the next call of a method fail
with a transient gRPC error. Becoming ACTIVE gives the node blank worker directories (a new slice's disks).

The client under test is google-cloud-tpu's own TpuClient with its gRPC transport on an insecure channel to this
server (the library has no REST transport for v2alpha1).
"""
from __future__ import annotations

import collections
import os
import pathlib
import shutil
import signal
import threading
from concurrent import futures

import grpc
from google.cloud import tpu_v2alpha1 as tpu
from google.longrunning import operations_pb2
from google.protobuf import any_pb2, empty_pb2
from google.rpc import status_pb2

TYPE_PREFIX = "type.googleapis.com/"


def worker_dirs(root: pathlib.Path, node_id: str) -> list[pathlib.Path]:
    return sorted((root / node_id).glob("worker-*"), key=lambda path: int(path.name.split("-")[1]))


def kill_workers(root: pathlib.Path, node_id: str) -> None:
    """SIGKILL every job process group started on the node's workers (a host going away)."""
    for worker in worker_dirs(root, node_id):
        pid_file = worker / "bertjax-job" / "pid"
        if pid_file.exists():
            try:
                os.killpg(int(pid_file.read_text().strip()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


class TpuStandIn:
    """The server and its state. `root/<node>/state` tells the stand-in gcloud whether the node is up;
    `root/<node>/worker-<i>/` are its workers' home directories."""

    def __init__(self, root: pathlib.Path, workers: int, plans=(), operation_polls: int = 1):
        self.root, self.workers = pathlib.Path(root), workers
        self.plans = collections.deque(plans)
        self.operation_polls = operation_polls
        self.resources: dict[str, dict] = {}      # queued resource name -> {"resource", "plan", "node"}
        self.operations: dict[str, list] = {}     # operation name -> [polls left, Operation, on_done]
        self.faults: dict[str, list] = collections.defaultdict(list)
        self.calls: list[tuple[str, str]] = []    # (method, name), for assertions
        self.lock = threading.RLock()
        self.server = None
        self._operation_count = 0

    # --- test controls ---
    def start(self) -> str:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        handlers = {
            "CreateQueuedResource": (tpu.CreateQueuedResourceRequest, self.create_queued_resource),
            "GetQueuedResource": (tpu.GetQueuedResourceRequest, self.get_queued_resource),
            "DeleteQueuedResource": (tpu.DeleteQueuedResourceRequest, self.delete_queued_resource),
            "GetNode": (tpu.GetNodeRequest, self.get_node),
        }
        rpc = {name: grpc.unary_unary_rpc_method_handler(
            self._guard(name, method), request_deserializer=request.deserialize,
            response_serializer=lambda message: type(message).serialize(message)
            if hasattr(type(message), "serialize") else message.SerializeToString())
            for name, (request, method) in handlers.items()}
        operations = {"GetOperation": grpc.unary_unary_rpc_method_handler(
            self._guard("GetOperation", self.get_operation),
            request_deserializer=operations_pb2.GetOperationRequest.FromString,
            response_serializer=operations_pb2.Operation.SerializeToString)}
        self.server.add_generic_rpc_handlers((
            grpc.method_handlers_generic_handler("google.cloud.tpu.v2alpha1.Tpu", rpc),
            grpc.method_handlers_generic_handler("google.longrunning.Operations", operations)))
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        return f"127.0.0.1:{port}"

    def stop(self) -> None:
        for record in list(self.resources.values()):
            kill_workers(self.root, record["node_id"])
        if self.server is not None:
            self.server.stop(grace=None)

    def fail_next(self, method: str, code=grpc.StatusCode.UNAVAILABLE) -> None:
        self.faults[method].append(code)

    def preempt(self, name: str) -> None:
        """A spot preemption: SUSPENDING (then SUSPENDED), the node PREEMPTED, its processes killed."""
        with self.lock:
            record = self.resources[name]
            record["plan"] = collections.deque(["SUSPENDING", "SUSPENDED"])
            self._set_state(record, "SUSPENDING")
        kill_workers(self.root, record["node_id"])

    # --- the API ---
    def _guard(self, method, function):
        def handle(request, context):
            with self.lock:
                name = getattr(request, "name", "") or getattr(request, "parent", "")
                if self.faults[method]:
                    code = self.faults[method].pop(0)
                    self.calls.append((f"{method} ({code.name})", name))
                    context.abort(code, f"stand-in: transient failure of {method}")
                self.calls.append((method, name))
            return function(request, context)
        return handle

    def _operation(self, parent: str, response=None, on_done=None, error: status_pb2.Status | None = None):
        self._operation_count += 1
        name = f"{parent}/operations/operation-{self._operation_count}"
        operation = operations_pb2.Operation(name=name, done=False)
        self.operations[name] = [self.operation_polls, response, on_done, error]
        return operation

    def get_operation(self, request, context):
        with self.lock:
            if request.name not in self.operations:
                context.abort(grpc.StatusCode.NOT_FOUND, f"operation {request.name} not found")
            entry = self.operations[request.name]
            entry[0] -= 1
            if entry[0] > 0:
                return operations_pb2.Operation(name=request.name, done=False)
            _, response, on_done, error = entry
            if on_done is not None:
                on_done()
                entry[2] = None
            operation = operations_pb2.Operation(name=request.name, done=True)
            if error is not None:
                operation.error.CopyFrom(error)
            else:
                packed = any_pb2.Any()
                if response is None:
                    packed.Pack(empty_pb2.Empty())
                else:
                    packed.type_url = TYPE_PREFIX + type(response).pb(response).DESCRIPTOR.full_name
                    packed.value = type(response).serialize(response)
                operation.response.CopyFrom(packed)
            return operation

    def create_queued_resource(self, request, context):
        with self.lock:
            name = f"{request.parent}/queuedResources/{request.queued_resource_id}"
            if name in self.resources:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"queued resource {name} already exists")
            resource = tpu.QueuedResource(request.queued_resource)
            resource.name = name
            node_id = resource.tpu.node_spec[0].node_id
            plan = self.plans.popleft() if self.plans else ["ACTIVE"]
            record = {"resource": resource, "node_id": node_id, "node": "CREATING",
                      "plan": collections.deque(plan)}
            self._set_state(record, "CREATING")
            self.resources[name] = record
            return self._operation(request.parent, response=resource)

    def _set_state(self, record, entry) -> None:
        state, reason = (entry, "") if isinstance(entry, str) else entry
        resource = record["resource"]
        resource.state = tpu.QueuedResourceState(state=tpu.QueuedResourceState.State[state])
        if state == "FAILED":
            code = 7 if "permission" in reason.lower() else 8  # PERMISSION_DENIED / RESOURCE_EXHAUSTED
            resource.state.failed_data = tpu.QueuedResourceState.FailedData(
                error=status_pb2.Status(code=code, message=reason))
        node_dir = self.root / record["node_id"]
        if state == "ACTIVE" and record["node"] != "READY":
            shutil.rmtree(node_dir, ignore_errors=True)  # a new slice: blank disks
            for index in range(self.workers):
                (node_dir / f"worker-{index}").mkdir(parents=True)
            record["node"] = "READY"
        elif state in ("SUSPENDING", "SUSPENDED"):
            record["node"] = "PREEMPTED"
        node_dir.mkdir(parents=True, exist_ok=True)
        (node_dir / "state").write_text(state)

    def get_queued_resource(self, request, context):
        with self.lock:
            record = self.resources.get(request.name)
            if record is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"queued resource {request.name} not found")
            if record["plan"]:
                self._set_state(record, record["plan"].popleft())
            return tpu.QueuedResource(record["resource"])

    def delete_queued_resource(self, request, context):
        with self.lock:
            record = self.resources.get(request.name)
            if record is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"queued resource {request.name} not found")
            if record["resource"].state.state.name == "ACTIVE" and not request.force:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the queued resource has a node: use force")
            record["plan"] = collections.deque()
            self._set_state(record, "DELETING")
            record["node"] = "DELETING"
            kill_workers(self.root, record["node_id"])

            def gone():
                self.resources.pop(request.name, None)
                (self.root / record["node_id"] / "state").write_text("GONE")

            # v2alpha1's delete operation answers with the queued resource (as it was when deleted).
            return self._operation(request.name.split("/queuedResources/")[0],
                                   response=tpu.QueuedResource(record["resource"]), on_done=gone)

    def get_node(self, request, context):
        with self.lock:
            parent, node_id = request.name.split("/nodes/")
            record = next((r for r in self.resources.values() if r["node_id"] == node_id
                           and r["resource"].name.startswith(parent + "/")), None)
            if record is None or record["node"] in ("CREATING", "DELETING"):
                context.abort(grpc.StatusCode.NOT_FOUND, f"node {request.name} not found")
            spec = record["resource"].tpu.node_spec[0].node
            return tpu.Node(name=request.name, accelerator_type=spec.accelerator_type,
                            runtime_version=spec.runtime_version, state=tpu.Node.State[record["node"]],
                            network_endpoints=[tpu.NetworkEndpoint(ip_address="127.0.0.1", port=8470)
                                               for _ in range(self.workers)])
