"""A directory at an fsspec URL (`s3://`, `gs://`, `hf://`, ...): reading its objects, with retries.

`RemoteDir` is what every reader and writer of object storage goes through: this
process's fsspec file system (s3fs's is not fork-safe, so each process makes its own), an
obstore client for `s3://` where the options allow one, and `retry`, which retries with
backoff within `FORGE_GRAIN_REMOTE_DEADLINE` and turns every failure into an error naming
the object. `listing` lists what is under a URL, with sizes and ETags.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import re
import threading
import time

from forge_grain.errors import StoreError
from forge_grain.processes import per_process, without_per_process
from forge_grain.stores.request_pool import RETRIES, bounded, deadline, request_deadline

log = logging.getLogger(__name__)
# a manifest a format probe read, for the open that follows it on the same thread (`probe_manifest`):
# taken once, and only this soon after the probe (the two are one call, `TokenStore(url)`)
_PROBED = threading.local()
PROBED_S = 1.0


class RemoteDir:
    """A directory at an fsspec URL, and the retrying every request to it goes through."""

    def __init__(self, url: str, storage_options: dict | None = None, retries: int = RETRIES):
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.retries = retries
        if obstore_reads(self.url, self.storage_options):  # fsspec's file system is made when first used (`fs`)
            self.root = self.url[len("s3://"):]
            return
        import fsspec

        fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        RemoteDir.fs.keep(self, fs)  # made here already; a forked child makes its own

    @per_process
    def fs(self):
        """This process's fsspec file system (s3fs's refuses to work in a forked child:
        its event loop and connections are the parent's). Where obstore reads, it is made
        only for what obstore does not do (listings, writes): importing s3fs took 0.23-0.29 s
        of a store's first open, a third of the time to its first batch behind a 30 ms link."""
        import fsspec

        return fsspec.core.url_to_fs(self.url, **self.storage_options)[0]

    @per_process
    def _fast(self):
        """This process's obstore client, or None (its runtime's threads are the parent's in a
        forked child: a request there never returns)."""
        return fast_client(self.url, self.storage_options)

    def __getstate__(self):
        return without_per_process(self.__dict__)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def read_range(self, name: str, start: int, end: int | None = None, if_match: str | None = None):
        """Bytes [start, end) of object `name` (`read_range(name, 0)`: all of it, in one GET
        whose size need not be known first), as a bytes-like buffer: through obstore where
        `fast_client` made one (a Rust client: a fraction of s3fs's CPU a request; its buffer
        is written and hashed as it is, not copied into `bytes` under the GIL first), else
        through fsspec. `if_match` (an ETag, with `end`): through obstore the read is of that
        version only, or an error (`changed_under`); through fsspec the caller checks it
        (`check_unchanged`), as fsspec's reads take no conditions."""
        if self._fast is None:
            return self.fs.cat_file(self.path(name), start=start, end=end)
        import obstore

        store, prefix = self._fast
        with self._obstore_errors(name, store):
            if end is None:
                return memoryview(obstore.get(store, f"{prefix}{name}").bytes())[start:]
            if if_match is not None:
                got = obstore.get(store, f"{prefix}{name}", options={"range": (start, end), "if_match": if_match})
                return memoryview(got.bytes())
            return memoryview(obstore.get_range(store, f"{prefix}{name}", start=start, end=end))

    def read_bounded(self, name: str, start: int, end: int | None = None, if_match: str | None = None):
        """`read_range`, an error once it takes `request_deadline()` seconds: through obstore by
        its client's own timeout (`fast_client`), else on a thread of its own (`bounded`). A
        thread for every read was two more hand-overs of the GIL a request: while the consumer
        ran Python, each waited up to the 5 ms switch interval."""
        if self._fast is not None:
            return self.read_range(name, start, end, if_match)
        return bounded(self.read_range, name, start, end, if_match)

    def fresh(self, name: str, missing_ok: bool = False) -> bytes | None:
        """Object `name`'s current bytes (no cache): the manifest, which says what else to trust.
        Through obstore one GET (a body cut short is the client's error); through fsspec the
        size is asked as well, so that a cut-off read is never taken."""
        def attempt():
            if self._fast is not None:
                return bytes(self.read_range(name, 0))
            data = self.fs.cat_file(self.path(name))
            size = self.fs.size(self.path(name))
            if len(data) != size:
                raise Damaged(f"{len(data)} bytes arrived of {size}")
            return data

        return self.retry(name, attempt, missing_ok=missing_ok)

    def probe_manifest(self, name: str) -> bool:
        """Whether object `name` (a store's manifest) is here, read whole to find out: the open
        that follows the probe on this thread takes the bytes (`probed`) instead of asking
        again (a HEAD then a GET were two round trips before a store's first batch)."""
        data = self.fresh(name, missing_ok=True)
        _PROBED.last = None if data is None else (self.url, name, self.storage_options, data, time.monotonic())
        return data is not None

    def probed(self, name: str) -> bytes | None:
        """Object `name` as `probe_manifest` read it just now on this thread at this URL (taken
        once), else None."""
        last, _PROBED.last = getattr(_PROBED, "last", None), None
        if last is not None and last[:3] == (self.url, name, self.storage_options) and \
                time.monotonic() - last[4] < PROBED_S:
            return last[3]
        return None

    def size(self, name: str) -> int:
        """Object `name`'s size (a HEAD): through obstore where `fast_client` made one (s3fs's
        first request sets up its client: 0.3-0.5 s before a store's first batch), else fsspec."""
        if self._fast is None:
            return self.fs.size(self.path(name))
        import obstore

        store, prefix = self._fast
        with self._obstore_errors(name, store):
            return int(obstore.head(store, f"{prefix}{name}")["size"])

    @contextlib.contextmanager
    def _obstore_errors(self, name: str, store):
        """obstore's errors for object `name` (read with client `store`) as the ones `retry`
        knows: a missing object, one changed under a conditional read, refused credentials, a
        bucket in another region (`_relocated`)."""
        from obstore.exceptions import (GenericError, NotFoundError, PermissionDeniedError, PreconditionError,
                                        UnauthenticatedError)

        try:
            yield
        except GenericError as e:
            if "incorrectly configured region" in str(e):  # (object_store's words for S3's 301)
                raise self._relocated(store.config.get("region")) from None
            if "kind: Timeout" not in str(e):
                raise
            raise TimeoutError(f"no answer within {client_timeout(self.storage_options):g} s") from None
        except NotFoundError:
            raise FileNotFoundError(f"{self.url}/{name}") from None
        except PreconditionError:
            raise changed_under(f"{self.url}/{name}") from None
        except (PermissionDeniedError, UnauthenticatedError) as e:
            raise PermissionError(str(e).splitlines()[0]) from None

    def _relocated(self, signed: str) -> "MovedBucket":
        """The bucket is in another region than `signed`, the one obstore's client signed for:
        S3 answers such a request with a 301 without a Location, which botocore (s3fs)
        follows and obstore does not. The bucket's region is asked (`bucket_region`, once a
        process) and the client made again for it; the error says so, and the attempt is
        retried. A bucket whose region the server does not say is a StoreError naming the
        option that says it."""
        bucket, endpoint = bucket_of(self.url), endpoint_of(self.storage_options)
        with _REGIONS_LOCK:
            region = _REGIONS.get((endpoint, bucket))
            if region in (None, signed):
                region = bucket_region(endpoint, bucket)
            if region in (None, signed):
                raise StoreError(f"{self.url}: the server refuses requests signed for region {signed!r} (the bucket "
                                 "is in another) and does not say which: pass storage_options={'client_kwargs': "
                                 "{'region_name': ...}} with the bucket's region")
            _REGIONS[(endpoint, bucket)] = region
        RemoteDir._fast.forget(self)  # (the next request makes the client for `region`)
        return MovedBucket(f"bucket {bucket!r} is in {region}, not {signed}: asking there")

    def conditional(self, tag: str | None) -> str | None:
        """`tag` (a listing's) as a read's condition: an ETag, read through obstore (which
        sends it with every GET), or None (the reads are checked after, `check_unchanged`)."""
        return tag if tag and tag.startswith('"') and self._fast is not None else None

    def retry(self, name: str, attempt, missing_ok: bool = False, bound: bool = True):
        """`attempt()`, retried with exponential backoff until `retries` attempts or `deadline()`
        seconds are spent; a missing object is not retried (and gives None with `missing_ok`).
        Each attempt is `bounded` (`bound=False` for an attempt of many requests that bounds
        each itself)."""
        where = f"{self.url}/{name}" if name else self.url  # the object, or the URL for its listing
        start, limit = time.monotonic(), deadline()
        for k in range(self.retries):
            if k and time.monotonic() - start + request_deadline() > limit:
                break  # another attempt that hangs would end past the deadline
            tried = k + 1
            try:
                return bounded(attempt) if bound else attempt()
            except FileNotFoundError:
                if missing_ok:
                    return None
                raise StoreError(f"{where}: FileNotFoundError (no such object); check the URL and credentials") from None
            except PermissionError as e:
                raise StoreError(f"{where}: {e.__class__.__name__} ({e}); check the URL and credentials") from None
            except StoreError:  # (what no attempt can mend: the object changed)
                raise
            except Exception as e:  # network errors come as many types (OSError, botocore, aiohttp, timeouts)
                last = e
                log.info("forge-grain: %s: attempt %d failed (%s: %s); trying again", where, tried,
                         e.__class__.__name__, e)
                time.sleep(min(0.05 * 2**k, 2.0))
        spent = time.monotonic() - start
        raise StoreError(f"{where}: failed after {tried} attempts in {spent:.0f} s: {last.__class__.__name__}: {last} "
                         f"(FORGE_GRAIN_REMOTE_DEADLINE={limit:g} s bounds an object's attempts)") from None


class Damaged(Exception):
    """A download that arrived incomplete or with the wrong checksum (retried)."""


class MovedBucket(Exception):
    """A request signed for another region than its bucket's (retried once the client signs
    for the bucket's: `RemoteDir._relocated`)."""


_REGIONS: dict[tuple[str | None, str], str] = {}  # (endpoint, bucket) -> its region, as the server said
_REGIONS_LOCK = threading.Lock()
_OBSTORE_PID: int | None = None  # the process whose obstore runtime this memory holds, if any
FAST_OPTIONS = {"key", "secret", "token", "anon", "profile", "endpoint_url", "client_kwargs", "config_kwargs",
                "skip_instance_cache", "use_listings_cache"}


def fast_client(url: str, storage_options: dict | None):
    """(an obstore `S3Store`, the key prefix) for an `s3://` URL whose storage options
    obstore can honour (explicit `key`/`secret`, `anon`, or none: boto's credential chain,
    `profile` included, as s3fs reads it; `endpoint_url`, the region and timeouts), when
    obstore is installed; None otherwise (then s3fs reads: a requester-pays bucket, a
    session's own options) or where the chain finds no credentials (s3fs then says why).
    Its own retries are off: `RemoteDir.retry` retries.

    None too in a process forked from one that made an obstore client: obstore runs its
    requests on one tokio runtime per process, whose threads a forked child does not have,
    and a request there never returns (tokio does not support fork). Such a child (a
    DataLoader worker) reads through s3fs, which starts afresh after a fork; a worker started
    by "spawn" or "forkserver" uses obstore."""
    global _OBSTORE_PID
    if not obstore_reads(url, storage_options):
        return None
    import datetime

    from obstore.store import S3Store

    opts = dict(storage_options or {})
    provider, region = None, None
    if not (opts.get("anon") or opts.get("key")):
        provider, region = chain_credentials(opts.get("profile"))
        if provider is None:
            return None
    _OBSTORE_PID = os.getpid()
    bucket, _, prefix = url[len("s3://"):].partition("/")
    client_kwargs, config_kwargs = opts.get("client_kwargs") or {}, opts.get("config_kwargs") or {}
    endpoint = endpoint_of(opts)
    config = {"region": _REGIONS.get((endpoint, bucket)) or client_kwargs.get("region_name") or region
              or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"}
    if opts.get("anon"):
        config["skip_signature"] = True
    elif provider is None:
        config.update(access_key_id=opts["key"], secret_access_key=opts["secret"])
        if opts.get("token"):
            config["session_token"] = opts["token"]
    client = {"timeout": f"{client_timeout(opts):g}s",
              "connect_timeout": f"{config_kwargs.get('connect_timeout', 60):g}s"}
    if endpoint:
        config.update(endpoint=endpoint, virtual_hosted_style_request=False)
        client["allow_http"] = endpoint.startswith("http://")
    retry = {"max_retries": 0, "retry_timeout": datetime.timedelta(seconds=request_deadline())}
    store = S3Store(bucket, config=config, client_options=client, retry_config=retry, credential_provider=provider)
    return store, f"{prefix.strip('/')}/" if prefix.strip("/") else ""


def obstore_reads(url: str, storage_options: dict | None) -> bool:
    """Whether `fast_client` makes an obstore client for `url` in this process (see there)."""
    opts = storage_options or {}
    if not url.startswith("s3://") or set(opts) - FAST_OPTIONS:
        return False
    chain = not (opts.get("key") or opts.get("secret") or opts.get("token")) and _installed("botocore")
    if not (opts.get("anon") or (opts.get("key") and opts.get("secret")) or chain):
        return False
    return _OBSTORE_PID in (None, os.getpid()) and _installed("obstore")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def chain_credentials(profile: str | None) -> tuple:
    """(obstore's credential provider, the profile's region) from boto's credential chain, as
    s3fs finds them when no key is given (the environment, a web identity, SSO, the shared
    files and `profile`, the container's or the instance's role); (None, None) where it
    finds none, or the profile is not there (s3fs then says so). Found once a process for
    each profile and environment (30-40 ms a lookup, and each store's clients ask)."""
    aws = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    return _chain(profile, aws, os.getpid())


@functools.lru_cache(maxsize=8)
def _chain(profile: str | None, _aws_environment: tuple, _pid: int) -> tuple:
    import botocore.exceptions
    import botocore.session

    try:
        session = botocore.session.Session(profile=profile)
        credentials = session.get_credentials()
        region = session.get_config_variable("region")
    except botocore.exceptions.BotoCoreError:
        return None, None
    return (None, None) if credentials is None else (ChainCredentials(credentials), region)


class ChainCredentials:
    """obstore's credentials from boto's `credentials`, asked again every `TTL` (botocore
    refreshes a role's before they expire; obstore keeps each answer until its `expires_at`)."""

    TTL = 600  # seconds

    def __init__(self, credentials):
        self.credentials = credentials

    def __call__(self) -> dict:
        import datetime

        frozen = self.credentials.get_frozen_credentials()
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key, "token": frozen.token,
                "expires_at": datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=self.TTL)}


def bucket_of(url: str) -> str:
    return url[len("s3://"):].split("/", 1)[0]


def endpoint_of(storage_options: dict) -> str | None:
    """The server the options name (None: AWS's)."""
    return storage_options.get("endpoint_url") or (storage_options.get("client_kwargs") or {}).get("endpoint_url")


def bucket_region(endpoint: str | None, bucket: str) -> str | None:
    """The region the server says `bucket` is in, or None: S3 names it (`x-amz-bucket-region`)
    in its answer to a HEAD of the bucket, signed or not, 200, 301 or 403 alike. Asked at
    `endpoint`, or AWS's for the bucket; a name S3 would refuse is not asked (it goes into
    a URL)."""
    import urllib.error
    import urllib.request

    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        return None
    if endpoint or "." in bucket:  # (a dotted name is no host name AWS's certificate covers)
        url = f"{(endpoint or 'https://s3.amazonaws.com').rstrip('/')}/{bucket}"
    else:
        url = f"https://{bucket}.s3.amazonaws.com"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=request_deadline()) as answer:
            return answer.headers.get("x-amz-bucket-region") or None
    except urllib.error.HTTPError as e:
        return e.headers.get("x-amz-bucket-region") or None
    except OSError:
        return None


def client_timeout(storage_options: dict) -> float:
    """Seconds one obstore request may take, connecting to the body's last byte: the request's
    share of the deadline (`request_deadline`), or a shorter `read_timeout` the options give."""
    read_timeout = (storage_options.get("config_kwargs") or {}).get("read_timeout")
    return min(float(read_timeout), request_deadline()) if read_timeout else request_deadline()


def read_or_none(remote: RemoteDir, name: str) -> bytes | None:
    return remote.retry(name, lambda: remote.fs.cat_file(remote.path(name)), missing_ok=True)


def listing(remote: RemoteDir) -> dict[str, tuple[int, str]]:
    """Every file under the URL (relative name -> (size, ETag or modification time)), hidden
    ones (forge-grain's own markers, caches) left out; empty when there is nothing."""
    remote.fs.invalidate_cache(remote.root)
    found = remote.retry("", lambda: remote.fs.find(remote.root, detail=True), missing_ok=True) or {}
    out = {}
    for path, entry in found.items():
        name = str(path)[len(remote.root):].lstrip("/")
        if entry.get("type", "file") != "file" or not name or any(p.startswith(".") for p in name.split("/")):
            continue
        out[name] = (int(entry["size"]), _tag(entry))
    return out


def objects_at(url: str, storage_options: dict | None = None) -> tuple[str, dict, str | None]:
    """(the URL the objects are under, their `listing`, the last part of `url` when it names no
    directory): a directory's files, or, for a URL naming none (a Megatron prefix, one token
    file), its parent's objects named by its last part: `stem.idx`, `stem.bin` and `stem`."""
    found = listing(RemoteDir(url, storage_options))
    if found:
        return url, found, None
    base, stem = url.rsplit("/", 1)
    beside = listing(RemoteDir(base, storage_options))
    return base, {n: v for n, v in beside.items() if n in (f"{stem}.idx", f"{stem}.bin", stem)}, stem


def _tag(entry: dict) -> str:
    """What says an object's version in a listing's (or a HEAD's) entry: its ETag, or where the
    file system has none its modification time."""
    return str(entry.get("ETag") or entry.get("etag") or entry.get("LastModified") or entry.get("mtime") or "")


def check_unchanged(remote: RemoteDir, name: str, tag: str) -> None:
    """Object `name` still has the version `tag` its listing gave (one HEAD): bytes read from it
    since the listing belong to the version the dataset was indexed from."""
    remote.fs.invalidate_cache(remote.path(name))
    now = _tag(remote.retry(name, lambda: remote.fs.info(remote.path(name))))
    if now != tag:
        raise changed_under(f"{remote.url}/{name}")


def changed_under(url: str) -> StoreError:
    """The error of a process that finds other data at a URL than the pipeline it serves opened."""
    return StoreError(f"{url}: the data at this URL changed after the pipeline opened it (it was rewritten in "
                      "place); this process would read other documents than the pipeline's plan and states describe. "
                      "Build the pipeline again, and resume only from a state saved with the data there now")


def remote_sizes(remote: RemoteDir) -> dict[str, int]:
    """Size of each object directly under the URL."""
    return {name: size for name, (size, _) in listing(remote).items() if "/" not in name}
