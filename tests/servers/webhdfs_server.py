"""A WebHDFS-protocol server over a local directory (stdlib only, own process), for tests.

    python tests/servers/webhdfs_server.py ROOT --port 0 --data-port 0     # prints "ready NN_PORT DN_PORT"

The namenode port answers GETFILESTATUS, LISTSTATUS, GETCONTENTSUMMARY, GETHOMEDIRECTORY, MKDIRS,
RENAME, DELETE, and redirects CREATE, APPEND and OPEN (307) to the datanode port, which moves the
bytes, as a real cluster does.  Errors are RemoteException JSON with HDFS's status codes.  It covers
the HTTP protocol only: no leases, replication, block locations, permissions or Kerberos.
Exits on SIGTERM, SIGINT or when its parent process dies.
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import shutil
import signal
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

PREFIX = "/webhdfs/v1"
JAVA = {  # exception -> (HTTP status, Java class), as HDFS's ExceptionHandler maps them
    "IllegalArgumentException": (400, "java.lang.IllegalArgumentException"),
    "UnsupportedOperationException": (400, "java.lang.UnsupportedOperationException"),
    "FileNotFoundException": (404, "java.io.FileNotFoundException"),
    "FileAlreadyExistsException": (403, "org.apache.hadoop.fs.FileAlreadyExistsException"),
    "ParentNotDirectoryException": (403, "org.apache.hadoop.fs.ParentNotDirectoryException"),
    "PathIsNotEmptyDirectoryException": (403, "org.apache.hadoop.fs.PathIsNotEmptyDirectoryException"),
    "IOException": (403, "java.io.IOException"),
}


class HDFSError(Exception):
    def __init__(self, exception: str, message: str) -> None:
        super().__init__(message)
        self.exception = exception


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a real namenode
    server: ThreadingHTTPServer  # with .root, .datanode (host:port or None for the datanode itself)

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self.dispatch("GET")

    def do_PUT(self) -> None:
        self.dispatch("PUT")

    def do_POST(self) -> None:
        self.dispatch("POST")

    def do_DELETE(self) -> None:
        self.dispatch("DELETE")

    def dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        self.query = dict(parse_qsl(url.query))
        self.hpath = posixpath.normpath("/" + unquote(url.path[len(PREFIX) :]).lstrip("/"))
        self.local = os.path.join(self.server.root, self.hpath.lstrip("/"))
        op = self.query.get("op", "").upper()
        self.body_started = False
        try:
            if not url.path.startswith(PREFIX):
                raise HDFSError("IllegalArgumentException", f"not a WebHDFS path: {url.path}")
            role = "datanode" if self.server.datanode is None else "namenode"
            handler = getattr(self, f"{role}_{method}_{op}", None)
            if handler is None:
                raise HDFSError("UnsupportedOperationException", f"{op or 'no op'} by {method} on the {role}")
            handler()
        except HDFSError as e:
            self.skip_body()
            status, java = JAVA[e.exception]
            self.reply(
                status, {"RemoteException": {"exception": e.exception, "javaClassName": java, "message": str(e)}}
            )
        except OSError as e:  # ENOTDIR, EISDIR, ...: what HDFS reports as a plain IOException
            self.skip_body()
            self.reply(
                403,
                {
                    "RemoteException": {
                        "exception": "IOException",
                        "javaClassName": "java.io.IOException",
                        "message": f"{self.hpath}: {e.strerror}",
                    }
                },
            )

    # -- helpers --------------------------------------------------------------------------------
    def reply(self, status: int, body: dict | None = None, headers: dict | None = None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def body_chunks(self):
        """The request body, in pieces (Content-Length or chunked)."""
        self.body_started = True
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while size := int(self.rfile.readline().split(b";")[0], 16):
                yield self.rfile.read(size)
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return
        left = int(self.headers.get("Content-Length") or 0)
        while left > 0 and (chunk := self.rfile.read(min(left, 1 << 20))):
            left -= len(chunk)
            yield chunk

    def skip_body(self) -> None:
        """Read what is left of the body, so the connection can be kept; close it if unsure."""
        if self.body_started:
            self.close_connection = True
        else:
            for _ in self.body_chunks():
                pass

    def need(self, kind: str | None = None) -> os.stat_result:
        try:
            st = os.stat(self.local)
        except (FileNotFoundError, NotADirectoryError):
            raise HDFSError("FileNotFoundException", f"File does not exist: {self.hpath}") from None
        if kind == "file" and stat.S_ISDIR(st.st_mode):
            raise HDFSError("FileNotFoundException", f"Path is not a file: {self.hpath}")
        return st

    def status(self, local: str, suffix: str) -> dict:
        st = os.stat(local)
        isdir = stat.S_ISDIR(st.st_mode)
        return {
            "accessTime": int(st.st_atime * 1000),
            "blockSize": 0 if isdir else 128 << 20,
            "childrenNum": len(os.listdir(local)) if isdir else 0,
            "fileId": st.st_ino,
            "group": "supergroup",
            "length": 0 if isdir else st.st_size,
            "modificationTime": int(st.st_mtime * 1000),
            "owner": self.query.get("user.name", "hdfs"),
            "pathSuffix": suffix,
            "permission": f"{st.st_mode & 0o777:o}",
            "replication": 0 if isdir else 1,
            "storagePolicy": 0,
            "type": "DIRECTORY" if isdir else "FILE",
        }

    def redirect(self) -> None:
        self.skip_body()
        query = urlencode({**self.query, "namenoderpcaddress": f"{self.server.host}:{self.server.server_port}"})
        location = f"http://{self.server.datanode}{PREFIX}{quote(self.hpath)}?{query}"
        self.reply(307, None, {"Location": location})

    # -- namenode -------------------------------------------------------------------------------
    def namenode_GET_GETFILESTATUS(self) -> None:
        self.need()
        self.reply(200, {"FileStatus": self.status(self.local, "")})

    def namenode_GET_LISTSTATUS(self) -> None:
        st = self.need()
        if not stat.S_ISDIR(st.st_mode):
            return self.reply(200, {"FileStatuses": {"FileStatus": [self.status(self.local, "")]}})
        entries = [self.status(os.path.join(self.local, n), n) for n in sorted(os.listdir(self.local))]
        self.reply(200, {"FileStatuses": {"FileStatus": entries}})

    def namenode_GET_GETCONTENTSUMMARY(self) -> None:
        st = self.need()
        dirs, files, length = (1, 0, 0) if stat.S_ISDIR(st.st_mode) else (0, 1, st.st_size)
        for top, dnames, fnames in os.walk(self.local):
            dirs += len(dnames)
            files += len(fnames)
            length += sum(os.path.getsize(os.path.join(top, f)) for f in fnames)
        summary = {
            "directoryCount": dirs,
            "fileCount": files,
            "length": length,
            "quota": -1,
            "spaceConsumed": length,
            "spaceQuota": -1,
        }
        self.reply(200, {"ContentSummary": summary})

    def namenode_GET_GETHOMEDIRECTORY(self) -> None:
        self.reply(200, {"Path": f"/user/{self.query.get('user.name', 'hdfs')}"})

    def namenode_PUT_MKDIRS(self) -> None:
        if os.path.isfile(self.local):
            raise HDFSError("FileAlreadyExistsException", f"Path is not a directory: {self.hpath}")
        os.makedirs(self.local, exist_ok=True)
        self.reply(200, {"boolean": True})

    def namenode_PUT_RENAME(self) -> None:
        """HDFS rename semantics: False (not an error) when src is missing, dst's parent is missing,
        or dst is an existing file; into dst when dst is a directory."""
        dst = posixpath.normpath("/" + self.query.get("destination", "").lstrip("/"))
        dlocal = os.path.join(self.server.root, dst.lstrip("/"))
        if os.path.isdir(dlocal) and dst != self.hpath:
            dst, dlocal = (
                posixpath.join(dst, posixpath.basename(self.hpath)),
                os.path.join(dlocal, os.path.basename(self.local)),
            )
        ok = (
            os.path.exists(self.local)
            and self.hpath != "/"
            and os.path.isdir(os.path.dirname(dlocal))
            and not os.path.exists(dlocal)
            and not (dst + "/").startswith(self.hpath + "/")
        )
        if ok:
            os.rename(self.local, dlocal)
        self.reply(200, {"boolean": ok or dst == self.hpath})

    def namenode_DELETE_DELETE(self) -> None:
        if self.hpath == "/" or not os.path.lexists(self.local):
            return self.reply(200, {"boolean": False})
        if os.path.isdir(self.local):
            if os.listdir(self.local) and self.query.get("recursive", "false") != "true":
                raise HDFSError(
                    "PathIsNotEmptyDirectoryException", f"`{self.hpath} is non empty': Directory is not empty"
                )
            shutil.rmtree(self.local)
        else:
            os.remove(self.local)
        self.reply(200, {"boolean": True})

    def namenode_PUT_CREATE(self) -> None:
        if os.path.isdir(self.local):
            raise HDFSError("FileAlreadyExistsException", f"{self.hpath} already exists as a directory")
        if os.path.exists(self.local) and self.query.get("overwrite", "false") != "true":
            raise HDFSError("FileAlreadyExistsException", f"{self.hpath} for client already exists")
        parent = os.path.dirname(self.local)
        if os.path.exists(parent) and not os.path.isdir(parent):
            raise HDFSError(
                "ParentNotDirectoryException", f"Parent path is not a directory: {posixpath.dirname(self.hpath)}"
            )
        self.redirect()

    def namenode_POST_APPEND(self) -> None:
        self.need("file")
        self.redirect()

    def namenode_GET_OPEN(self) -> None:
        size = self.need("file").st_size
        offset = int(self.query.get("offset", 0))
        if offset < 0 or (offset >= size > 0):  # as HDFS's namenode: an empty file lets any offset through
            raise HDFSError("IOException", f"Offset={offset} out of the range [0, {size}); OPEN, path={self.hpath}")
        self.redirect()

    # -- datanode -------------------------------------------------------------------------------
    def write_body(self, mode: str) -> None:
        with open(self.local, mode) as f:
            for chunk in self.body_chunks():
                f.write(chunk)

    def datanode_PUT_CREATE(self) -> None:
        os.makedirs(os.path.dirname(self.local), exist_ok=True)
        self.write_body("wb")
        nn = self.query.get("namenoderpcaddress", "localhost")
        self.reply(201, None, {"Location": f"hdfs://{nn}{quote(self.hpath)}"})

    def datanode_POST_APPEND(self) -> None:
        self.need("file")
        self.write_body("ab")
        self.reply(200)

    def datanode_GET_OPEN(self) -> None:
        size = self.need("file").st_size
        offset = max(0, int(self.query.get("offset", 0)))
        if offset > size:  # the datanode's seek, as HDFS's DFSInputStream
            raise HDFSError("IOException", "Cannot seek after EOF")
        length = max(0, min(size - offset, int(self.query.get("length", size))))
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.end_headers()
        with open(self.local, "rb") as f:
            f.seek(offset)
            while length > 0 and (chunk := f.read(min(length, 1 << 20))):
                self.wfile.write(chunk)
                length -= len(chunk)


def serve(root: str, host: str, port: int, datanode: str | None) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.root, server.host, server.datanode = root, host, datanode
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root", help="local directory that holds the HDFS tree")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="namenode port (0: any free one)")
    p.add_argument("--data-port", type=int, default=0, help="datanode port (0: any free one)")
    args = p.parse_args()
    root = os.path.abspath(args.root)
    os.makedirs(root, exist_ok=True)
    dn = serve(root, args.host, args.data_port, None)
    nn = serve(root, args.host, args.port, f"{args.host}:{dn.server_port}")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"ready {nn.server_port} {dn.server_port}", flush=True)
    parent = os.getppid()
    while not stop.wait(0.5) and os.getppid() == parent:  # bounded: stop when the parent is gone
        pass
    for server in (nn, dn):
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
