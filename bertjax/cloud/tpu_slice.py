"""A Cloud TPU slice's life through the TPU API (google-cloud-tpu, v2alpha1): create, wait, read, delete.

Every queued-resource state gets a line saying what is going on and for how long. FAILED is read for its
reason: a stockout (no capacity in the zone) is retried with backoff up to a limit, anything else (quota,
permission, a bad request) stops with the API's message. API calls are retried on transient errors with the
client library's Retry; a delete is confirmed (the resource is gone) before the next create.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

from bertjax.runtime.extras import install_line

# The API's states that mean "this slice is not coming back": delete it and queue a new one.
PREEMPTED_STATES = ("SUSPENDING", "SUSPENDED")
# Node states that mean the workers are gone (the queued resource may still say ACTIVE for a moment).
NODE_GONE_STATES = ("PREEMPTED", "TERMINATED", "STOPPED", "STOPPING", "DELETING", "HIDDEN", "HIDING")
# TPU API emulators (tests) are reached over plaintext gRPC, as Google's own emulators are (PUBSUB_EMULATOR_HOST).
EMULATOR_HOST_ENV = "BERTJAX_TPU_EMULATOR_HOST"


class SliceError(RuntimeError):
    """The slice cannot be had (quota, permission, stockouts past the limit): waiting will not help."""


def tpu_client():
    """google-cloud-tpu's v2alpha1 client: Google's endpoint with the environment's credentials, or the emulator
    at $BERTJAX_TPU_EMULATOR_HOST (host:port, plaintext gRPC, no credentials). gRPC, because the library has no
    REST transport for v2alpha1 (the version with queued resources' `guaranteed.reserved`)."""
    try:
        from google.cloud import tpu_v2alpha1 as tpu
    except ImportError:
        raise ValueError(f"the TPU API client needs google-cloud-tpu (the `cloud` extra): {install_line('cloud')}") \
            from None

    host = os.environ.get(EMULATOR_HOST_ENV)
    if not host:
        return tpu.TpuClient()
    import grpc
    from google.cloud.tpu_v2alpha1.services.tpu.transports import TpuGrpcTransport

    return tpu.TpuClient(transport=TpuGrpcTransport(channel=grpc.insecure_channel(host)))


def api_retry(initial: float = 1.0, maximum: float = 60.0, timeout: float = 600.0):
    """Retry for transient API errors (unavailable, deadline, internal, rate limit), exponential backoff."""
    from google.api_core import exceptions, retry

    return retry.Retry(predicate=retry.if_exception_type(
        exceptions.ServiceUnavailable, exceptions.DeadlineExceeded, exceptions.InternalServerError,
        exceptions.TooManyRequests, exceptions.BadGateway), initial=initial, maximum=maximum, timeout=timeout)


def failure_kind(message: str, code: int = 0) -> str:
    """"stockout" (no capacity now: worth waiting for) or "fatal" (quota, permission, anything else)."""
    text = message.lower()
    if "quota" in text or "permission" in text or code == 7:  # 7: PERMISSION_DENIED
        return "fatal"
    if "capacity" in text or "stockout" in text or "stock-out" in text or "resource_exhausted" in text \
            or code in (8, 14):  # RESOURCE_EXHAUSTED without "quota"; UNAVAILABLE
        return "stockout"
    return "fatal"


def _elapsed(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s"


class Slice:
    """One queued resource (one node) by name: its state, its creation (with stockout retries) and deletion."""

    def __init__(self, spec, request_fn: Callable, client=None, poll_seconds: float = 30.0,
                 report_seconds: float = 600.0, stockout_retries: int = 20, stockout_backoff: float = 300.0,
                 retry=None, log: Callable[[str], None] = print):

        self.spec, self.request_fn, self.log = spec, request_fn, log
        self.client = client or tpu_client()
        self.poll_seconds, self.report_seconds = poll_seconds, report_seconds
        self.stockout_retries, self.stockout_backoff = stockout_retries, stockout_backoff
        self.retry = retry or api_retry()
        self.name = f"{spec.parent}/queuedResources/{spec.name}"

    def get(self):
        """The QueuedResource, or None when there is none by this name."""
        from google.api_core import exceptions

        try:
            return self.client.get_queued_resource(name=self.name, retry=self.retry)
        except exceptions.NotFound:
            return None

    def state(self) -> str:
        """The queued resource's state name ("ACTIVE", "WAITING_FOR_RESOURCES", ...), "GONE" when deleted."""
        resource = self.get()
        return "GONE" if resource is None else resource.state.state.name

    def node_state(self) -> str:
        """The node's state name ("READY", "PREEMPTED", ...), "GONE" when there is no node."""
        from google.api_core import exceptions

        try:
            node = self.client.get_node(name=f"{self.spec.parent}/nodes/{self.spec.name}", retry=self.retry)
        except exceptions.NotFound:
            return "GONE"
        return node.state.name

    def delete(self) -> None:
        """Deletes the queued resource (force: with its node) and waits until the API no longer has it."""
        from google.api_core import exceptions
        from google.cloud import tpu_v2alpha1 as tpu

        request = tpu.DeleteQueuedResourceRequest(name=self.name, force=True)
        for attempt in range(5):
            try:
                self.client.delete_queued_resource(request=request, retry=self.retry).result(
                    retry=self.retry, timeout=3600)
            except exceptions.NotFound:
                pass
            except exceptions.GoogleAPICallError as error:  # the operation failed: try again, then give up
                self.log(f"launch tpu: deleting {self.spec.name} failed ({error}); retrying")
                time.sleep(self.poll_seconds * (attempt + 1))
                continue
            # Confirmed only when the API no longer lists it: a create with the same name fails until then.
            started = time.monotonic()
            while (state := self.state()) != "GONE":
                if time.monotonic() - started > 3600:
                    break
                time.sleep(self.poll_seconds)
            if state == "GONE":
                self.log(f"launch tpu: {self.spec.name} deleted")
                return
        raise SliceError(f"queued resource {self.spec.name} could not be deleted; delete it with "
                         f"gcloud compute tpus queued-resources delete {self.spec.name} --force")

    def _create(self) -> None:
        from google.api_core import exceptions

        try:
            self.client.create_queued_resource(request=self.request_fn(), retry=self.retry).result(
                retry=self.retry, timeout=3600)
        except exceptions.AlreadyExists:
            pass  # a create whose answer was lost and then retried: the resource is there
        except exceptions.GoogleAPICallError as error:
            code = error.grpc_status_code.value[0] if error.grpc_status_code is not None else 0
            if failure_kind(error.message, code) == "fatal":
                raise SliceError(f"queued resource {self.spec.name} was refused: {error.message}") from error
            raise

    def acquire(self) -> bool:
        """Makes sure the slice is ACTIVE: reuses an active one, replaces a preempted/failed one, creates a missing
        one, waits through the queue. Returns True when a new slice was created (its workers are blank)."""
        created, stockouts = False, 0
        state = self.state()
        while True:
            if state == "ACTIVE":
                return created
            if state in (*PREEMPTED_STATES, "FAILED", "DELETING"):
                self.log(f"launch tpu: {self.spec.name} is {state}; deleting it to queue a new one")
                self.delete()
                state = "GONE"
            if state == "GONE":
                self.log(f"launch tpu: creating queued resource {self.spec.name} ({self.spec.tpu_type}, "
                         f"{self.spec.provisioning})")
                self._create()
                created = True
            state, reason = self._wait_until_settled()
            if state == "FAILED":
                if failure_kind(reason) == "fatal":
                    raise SliceError(f"queued resource {self.spec.name} FAILED: {reason}")
                stockouts += 1
                if stockouts > self.stockout_retries:
                    raise SliceError(f"queued resource {self.spec.name}: no capacity after {stockouts} tries; "
                                     f"last reason: {reason}")
                wait = min(self.stockout_backoff * 2 ** (stockouts - 1), 8 * self.stockout_backoff)
                self.log(f"launch tpu: {self.spec.name} FAILED: {reason} (a stockout: try {stockouts}/"
                         f"{self.stockout_retries}, again in {_elapsed(wait)})")
                time.sleep(wait)

    def _wait_until_settled(self) -> tuple[str, str]:
        """Polls until ACTIVE, FAILED or preempted, with a line at every change and every report_seconds."""
        started = time.monotonic()
        last, last_report = None, started
        while True:
            resource = self.get()
            state = "GONE" if resource is None else resource.state.state.name
            now = time.monotonic()
            if state == "FAILED":
                error = resource.state.failed_data.error
                return state, error.message or f"code {error.code}"
            if state in ("ACTIVE", "GONE", *PREEMPTED_STATES):
                if state != "ACTIVE":
                    self.log(f"launch tpu: {self.spec.name} is {state} before it became ACTIVE")
                else:
                    self.log(f"launch tpu: {self.spec.name} is ACTIVE after {_elapsed(now - started)}")
                return state, ""
            if state != last or now - last_report >= self.report_seconds:
                what = {"WAITING_FOR_RESOURCES": "queued: waiting for capacity in the zone",
                        "PROVISIONING": "capacity found: the TPU VMs are being created",
                        "ACCEPTED": "accepted: about to queue", "CREATING": "being created"}.get(state, "waiting")
                self.log(f"launch tpu: {self.spec.name} {state}, {_elapsed(now - started)} since queued ({what})")
                last, last_report = state, now
            time.sleep(self.poll_seconds)
