"""Several moto servers holding the same objects, for `bench_cache_limit.py --servers N`.

moto answers in one Python process: about 400-500 ranged GETs of 512 KiB a second on one
core, whatever the machine's cores. A reader that asks many small GETs (a bounded cache: one
shard or a few blocks in flight, cut fine to fill the link) is then measured against that
ceiling, not its own. Here the first server is written as the benchmark writes it; every
object of its bucket is then copied to the others with the same ETag (a multipart object in
parts of its first part's size, which `HeadObject(PartNumber=1)` tells), and the shaped link
(`shaped_link.py` with several upstream ports) spreads its connections over all of them. An
ETag that comes out different stops the run: forge-grain checks an object's version on every
read, and a pool whose copies disagree would look like data rewritten under it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

BUCKET = "bench"


def start_servers(work: Path, n: int) -> tuple[list[int], list[subprocess.Popen]]:
    """`n` moto servers (`bench_scale.start_server`), each in its own process."""
    from bench_scale import start_server

    ports, procs = [], []
    for k in range(n):
        (work / f"server-{k}").mkdir(exist_ok=True)
        port, proc = start_server(work / f"server-{k}")
        ports.append(port)
        procs.append(proc)
    return ports, procs


def client(port: int):
    import s3fs

    return s3fs.S3FileSystem(key="bench", secret="bench", endpoint_url=f"http://127.0.0.1:{port}",
                             skip_instance_cache=True)


def mirror(ports: list[int], bucket: str = BUCKET) -> int:
    """Every object of `bucket` on the first server written to the others, each with the ETag
    it has there (each read from the first once); the objects copied."""
    source, targets = client(ports[0]), [client(port) for port in ports[1:]]
    for target in targets:
        target.mkdir(bucket)
    keys = sorted(source.find(bucket))
    for key in keys:
        bucket_name, name = key.split("/", 1)
        etag, data = source.call_s3("head_object", Bucket=bucket_name, Key=name)["ETag"], source.cat_file(key)
        part = source.call_s3("head_object", Bucket=bucket_name, Key=name, PartNumber=1)["ContentLength"] \
            if "-" in etag.strip('"') else None  # (a multipart object: the size of its parts)
        for target in targets:
            copy_object(target, key, data, etag, part)
    return len(keys)


def copy_object(target, key: str, data: bytes, etag: str, part: int | None) -> None:
    """`data` written to `key` at `target` in one PUT (`part` None) or in parts of `part`
    bytes, and checked to have ETag `etag` there."""
    bucket, name = key.split("/", 1)
    if part is None:
        target.call_s3("put_object", Bucket=bucket, Key=name, Body=data)
    else:
        upload = target.call_s3("create_multipart_upload", Bucket=bucket, Key=name)["UploadId"]
        done = []
        for k, a in enumerate(range(0, len(data), part), start=1):
            got = target.call_s3("upload_part", Bucket=bucket, Key=name, UploadId=upload, PartNumber=k,
                                 Body=data[a:a + part])
            done.append({"PartNumber": k, "ETag": got["ETag"]})
        target.call_s3("complete_multipart_upload", Bucket=bucket, Key=name, UploadId=upload,
                       MultipartUpload={"Parts": done})
    copied = target.call_s3("head_object", Bucket=bucket, Key=name)["ETag"]
    if copied != etag:
        raise SystemExit(f"servers.mirror: {key} has ETag {copied} on port {target.endpoint_url}, "
                         f"{etag} on the first server; the pool cannot serve it")
    target.cat_file(key, start=0, end=1)  # (the first GET of an object joins its parts: not in a reader's time)
