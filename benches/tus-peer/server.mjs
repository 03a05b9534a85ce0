// The @tus/server peer of benches/tus_peer.rs: the reference Node tus server with its file
// store, defaults otherwise (the file store writes through the page cache; it never calls
// fsync). Usage: node server.mjs PORT DIRECTORY. Prints "listening" once it accepts.
import http from 'node:http';
import { Server } from '@tus/server';
import { FileStore } from '@tus/file-store';

const [port, directory] = process.argv.slice(2);
const tus = new Server({
  path: '/files',
  relativeLocation: true,
  datastore: new FileStore({ directory }),
});
http
  .createServer((req, res) => tus.handle(req, res))
  .listen(Number(port), '127.0.0.1', () => console.log('listening'));
