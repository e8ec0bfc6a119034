"""A hub-like HTTP server for the client tests: serves the files of one model
folder as the repository org/tiny at one commit, through the two parts of the
Hugging Face hub's API that `slotstream pull` uses (the repository listing and
`resolve`, every file as an LFS file with its sha256 as ETag, byte ranges).

    python3 tiny_hub.py FOLDER PORT_FILE    (writes the port it listens on)
"""

import hashlib
import http.server
import json
import os
import sys

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "org/tiny"


def main():
    folder, port_file = sys.argv[1], sys.argv[2]
    files = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                files[name] = f.read()
    digests = {name: hashlib.sha256(content).hexdigest() for name, content in files.items()}
    listing = json.dumps({"id": REPO, "sha": COMMIT, "siblings": [{"rfilename": n} for n in files]}).encode()

    class Hub(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def requested_file(self):
            prefix = f"/{REPO}/resolve/"
            if not self.path.startswith(prefix):
                return None
            revision, _, name = self.path[len(prefix):].partition("/")
            return name if revision in ("main", COMMIT) and name in files else None

        def send_head(self, name, status, length, content_range=None):
            self.send_response(status)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("X-Linked-Etag", f'"{digests[name]}"')
            self.send_header("X-Linked-Size", str(len(files[name])))
            self.send_header("Content-Length", str(length))
            if content_range:
                self.send_header("Content-Range", content_range)
            self.end_headers()

        def do_HEAD(self):
            name = self.requested_file()
            if name is None:
                self.send_error(404)
                return
            self.send_head(name, 200, len(files[name]))

        def do_GET(self):
            if self.path in (f"/api/models/{REPO}/revision/main", f"/api/models/{REPO}/revision/{COMMIT}"):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(listing)))
                self.end_headers()
                self.wfile.write(listing)
                return
            name = self.requested_file()
            if name is None:
                self.send_error(404)
                return
            content = files[name]
            asked = self.headers.get("Range", "")
            if not asked.startswith("bytes="):
                self.send_head(name, 200, len(content))
                self.wfile.write(content)
                return
            first, _, last = asked[len("bytes="):].partition("-")
            start, end = int(first), min(int(last) if last else len(content) - 1, len(content) - 1)
            part = content[start:end + 1]
            self.send_head(name, 206, len(part), f"bytes {start}-{end}/{len(content)}")
            self.wfile.write(part)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(port_file + ".tmp", port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
