// An unmodified tus client (tus-js-client, pinned by package-lock.json) against a live
// node, driven by tests/tus.rs. Usage:
//   node upload.cjs <node_modules> <endpoint> <file> <chunkSize> <tenant> <stopAfterPatches|0> [uploadUrl]
// Uploads <file> with PATCHes of <chunkSize> bytes. With stopAfterPatches > 0 it aborts
// after that many successful PATCHes (a client that went away); with an uploadUrl it
// resumes that upload (HEAD, then PATCH from the server's offset). Prints one JSON line:
// {"url", "patches", "heads", "blobKey", "aborted"}.
const path = require('path');
const fs = require('fs');
const [modules, endpoint, file, chunkSize, tenant, stopAfter, uploadUrl] = process.argv.slice(2);
const tus = require(path.join(modules, 'tus-js-client'));

const data = fs.readFileSync(file);
let patches = 0;
let heads = 0;
let blobKey = null;
let upload;
const done = (result) => {
  process.stdout.write(JSON.stringify(result) + '\n');
  process.exit(0);
};
upload = new tus.Upload(data, {
  endpoint,
  uploadUrl: uploadUrl || null,
  chunkSize: Number(chunkSize),
  retryDelays: [100, 500, 1000],
  headers: { 'X-Graviton-Tenant-Id': tenant },
  metadata: { filename: path.basename(file) },
  storeFingerprintForResuming: false,
  onBeforeRequest(req) {
    if (req.getMethod() === 'HEAD') heads += 1;
  },
  onAfterResponse(req, res) {
    const key = res.getHeader('Graviton-Blob-Key');
    if (key) blobKey = key;
    if (req.getMethod() === 'PATCH' && res.getStatus() === 204) {
      patches += 1;
      if (Number(stopAfter) > 0 && patches >= Number(stopAfter)) {
        // Leave the upload unfinished, as a client that went away would.
        setImmediate(() =>
          upload.abort(false).then(() => done({ url: upload.url, patches, heads, blobKey, aborted: true })));
      }
    }
  },
  onError(error) {
    process.stderr.write(`tus upload failed: ${error}\n`);
    process.exit(1);
  },
  onSuccess() {
    done({ url: upload.url, patches, heads, blobKey, aborted: false });
  },
});
upload.start();
