"""One Cloud Storage object read and written under generation preconditions (google-cloud-storage).

An object's generation changes on every write, and a request may name the generation it expects
(`ifGenerationMatch`; 0: the object must not exist). That gives what a file system gives with O_EXCL and a lock:
create-if-absent, and replace or delete only what was read. The client retries 429s, 5xx and dropped connections
of such conditional requests itself (they are idempotent). A denied request is told in one line naming the
bucket and object.
"""
from __future__ import annotations

import functools

ABSENT = 0  # the generation a request names for "only if there is no such object"


class StorageDenied(ValueError):
    """Cloud Storage refused the job's credentials for an object (a ValueError: bertjax exits 2 with the line)."""


@functools.lru_cache(maxsize=1)
def _client():
    from google.cloud import storage

    # STORAGE_EMULATOR_HOST, when set, points it at a local stand-in (the tests' fake-gcs-server).
    return storage.Client()


def split(url: str) -> tuple[str, str]:
    """gs://BUCKET/NAME -> (BUCKET, NAME)."""
    bucket, _, name = url.removeprefix("gs://").partition("/")
    return bucket, name


class GcsObject:
    """gs://BUCKET/NAME: read with its generation, written only if its generation is the one expected."""

    def __init__(self, url: str):
        self.url = url
        bucket, name = split(url)
        self.blob = _client().bucket(bucket).blob(name)

    def _denied(self, error, doing: str) -> StorageDenied:
        bucket, name = split(self.url)
        return StorageDenied(f"{self.url}: permission denied {doing} object {name!r} in bucket {bucket!r} "
                             f"({error.code}); give the job's account storage.objects.* on gs://{bucket} "
                             "(roles/storage.objectUser), or use another --workdir")

    def read(self) -> tuple[bytes, int] | None:
        """(contents, generation), or None when there is no such object."""
        from google.api_core import exceptions

        while True:
            try:
                blob = self.blob.bucket.get_blob(self.blob.name)
                if blob is None:
                    return None
                # Pinned to the generation just listed: the bytes and the generation go together.
                return blob.download_as_bytes(if_generation_match=blob.generation), blob.generation
            except exceptions.NotFound:
                return None
            except exceptions.PreconditionFailed:  # rewritten between the two requests: read again
                continue
            except exceptions.Forbidden as error:
                raise self._denied(error, "reading") from None

    def write(self, data: bytes, generation: int) -> int | None:
        """Writes `data` if the object's generation is `generation` (ABSENT: if there is none); its new generation,
        or None when the precondition failed (someone else's write came first)."""
        from google.api_core import exceptions

        try:
            self.blob.upload_from_string(data, content_type="application/json", if_generation_match=generation)
        except exceptions.PreconditionFailed:
            return None
        except exceptions.Forbidden as error:
            raise self._denied(error, "writing") from None
        return self.blob.generation

    def delete(self, generation: int) -> bool:
        """Deletes the object if its generation is still `generation`; whether it did."""
        from google.api_core import exceptions

        try:
            self.blob.bucket.delete_blob(self.blob.name, if_generation_match=generation)
        except (exceptions.PreconditionFailed, exceptions.NotFound):
            return False
        except exceptions.Forbidden as error:
            raise self._denied(error, "deleting") from None
        return True
