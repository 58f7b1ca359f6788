/** This library's version (semver; kept equal to package.json's by a unit test). */
export const VERSION = '1.0.0';
