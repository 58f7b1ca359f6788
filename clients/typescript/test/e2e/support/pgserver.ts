// A private Postgres server for the stores of the end-to-end tests, so that restarting it
// (`pg_ctl restart -m fast`) touches nothing else: initdb into a temporary directory (as the
// `postgres` user when run as root), started with pg_ctl on a free port of 127.0.0.1, stopped
// and deleted at the end. One role logs in with a password (scram-sha-256), to be refused with a
// wrong one; every other connection is trusted.
//
// RELAY_CONSUMER_E2E_PG_BINDIR names PostgreSQL's bin directory (default: the newest
// /usr/lib/postgresql/*/bin, or initdb on the PATH).

import { execFileSync } from 'node:child_process';
import { chownSync, existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Client } from 'pg';

export const PASSWORD_ROLE = 'relay_e2e_password';
export const PASSWORD = 'right-password';

function bindir(): string {
  if (process.env.RELAY_CONSUMER_E2E_PG_BINDIR) return process.env.RELAY_CONSUMER_E2E_PG_BINDIR;
  const root = '/usr/lib/postgresql';
  if (existsSync(root)) {
    const versions = readdirSync(root).filter((v) => existsSync(join(root, v, 'bin', 'initdb'))).sort((a, b) => Number(b) - Number(a));
    if (versions[0]) return join(root, versions[0], 'bin');
  }
  try {
    const found = execFileSync('sh', ['-c', 'command -v initdb'], { encoding: 'utf8' }).trim();
    if (found) return found.replace(/\/initdb$/, '');
  } catch {
    // none on the PATH
  }
  throw new Error('no initdb: set RELAY_CONSUMER_E2E_PG_BINDIR to PostgreSQL\'s bin directory');
}

export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const address = server.address();
      server.close(() => resolve(typeof address === 'object' && address ? address.port : 0));
    });
  });
}

export class PrivatePostgres {
  readonly root: string;
  readonly data: string;
  readonly log: string;
  port = 0;
  private readonly bin = bindir();
  private readonly asPostgres = process.getuid?.() === 0;

  constructor() {
    this.root = mkdtempSync(join(tmpdir(), 'relay-ts-pg-'));
    this.data = join(this.root, 'data');
    this.log = join(this.root, 'server.log');
  }

  private run(tool: string, ...args: string[]): string {
    const command = join(this.bin, tool);
    const [file, argv] = this.asPostgres ? ['runuser', ['-u', 'postgres', '--', command, ...args]] : [command, args];
    try {
      return execFileSync(file, argv, { encoding: 'utf8', timeout: 120_000, stdio: ['ignore', 'pipe', 'pipe'] });
    } catch (error) {
      const e = error as { status?: number; stdout?: string; stderr?: string };
      const log = existsSync(this.log) ? readFileSync(this.log, 'utf8').slice(-2000) : '';
      throw new Error(`${file} ${argv.join(' ')} exited ${e.status}:\n${e.stdout ?? ''}\n${e.stderr ?? ''}\n${log}`);
    }
  }

  dsn(database = 'postgres', user = 'postgres', password?: string): string {
    const auth = password === undefined ? user : `${user}:${encodeURIComponent(password)}`;
    return `postgres://${auth}@127.0.0.1:${this.port}/${database}`;
  }

  async start(): Promise<void> {
    this.port = await freePort();
    if (this.asPostgres) {
      const [uid, gid] = ['-u', '-g'].map((flag) => Number(execFileSync('id', [flag, 'postgres'], { encoding: 'utf8' }).trim()));
      chownSync(this.root, uid!, gid!);
    }
    this.run('initdb', '-D', this.data, '-U', 'postgres', '--auth=trust', '--no-sync', '-E', 'UTF8', '--locale=C');
    writeFileSync(join(this.data, 'pg_hba.conf'), [
      `host all ${PASSWORD_ROLE} 127.0.0.1/32 scram-sha-256`,
      'host all all 127.0.0.1/32 trust',
      'local all all trust',
      '',
    ].join('\n'));
    this.run('pg_ctl', '-D', this.data, '-l', this.log, '-w', '-t', '60', '-o',
      `-p ${this.port} -k ${this.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=60`, 'start');
    await this.query(`CREATE ROLE ${PASSWORD_ROLE} LOGIN SUPERUSER PASSWORD '${PASSWORD}'`);
  }

  /** `pg_ctl restart -m fast`: every connection terminated, the server down a moment. */
  restart(): void {
    this.run('pg_ctl', '-D', this.data, '-l', this.log, '-w', '-t', '60', '-m', 'fast', 'restart');
  }

  /** Stops the server (when it runs) and deletes its directory. */
  stop(): void {
    try {
      if (existsSync(join(this.data, 'postmaster.pid'))) this.run('pg_ctl', '-D', this.data, '-w', '-t', '30', '-m', 'immediate', 'stop');
    } finally {
      rmSync(this.root, { recursive: true, force: true });
    }
  }

  async query(sql: string, database = 'postgres'): Promise<void> {
    const client = new Client({ connectionString: this.dsn(database) });
    await client.connect();
    try {
      await client.query(sql);
    } finally {
      await client.end();
    }
  }

  async createDatabase(name: string): Promise<string> {
    await this.query(`CREATE DATABASE ${name}`);
    return this.dsn(name);
  }
}
