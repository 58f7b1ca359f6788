export * from './message';
export * from './follower';
export * from './store';
export * from './errors';
export * from './logger';
export { VERSION } from './version';
export { MemoryStore, MemoryStoreOptions } from './memory-store';
export {
  PgStore, PgStoreOptions, SCHEMA_SQL, SCHEMA_TABLE_SQL, SCHEMA_VERSION, MIGRATIONS, MIGRATION_LOCK, LIBRARY,
} from './pg-store';
export * from './api';
export * from './consumer';
export { verifyStore, verdictLine, VerifyOptions, EndpointVerdict, Difference } from './verify';
