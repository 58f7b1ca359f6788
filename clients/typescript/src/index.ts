export * from './message';
export * from './follower';
export * from './store';
export { MemoryStore, MemoryStoreOptions } from './memory-store';
export { PgStore, PgStoreOptions, SCHEMA_SQL } from './pg-store';
export * from './api';
export * from './consumer';
