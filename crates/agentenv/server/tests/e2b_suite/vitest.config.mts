// E2B's JS suite (packages/js-sdk/tests) against agentenv: the folders that talk to the server, the Node projects of
// E2B's own vitest.config.mts without its browser project (no Playwright here). run.sh copies this file beside the
// tests. With E2B_JS_SDK set (run.sh installs that npm release as `e2b`), the tests' imports of the SDK's entry
// points (src, src/index.js, src/errors) load the release, and only the files that import nothing else of the SDK
// and mock nothing run: a mock (msw, vi.mock of src/undici) cannot reach into the release's bundle.
import { readdirSync, readFileSync } from 'node:fs'
import { defineConfig } from 'vitest/config'

const timeout = Number(process.env.TEST_TIMEOUT_S ?? 180) * 1000
const alias = process.env.E2B_JS_SDK
  ? [{ find: /^(\.\.\/)+src(\/index\.js|\/errors(\.js)?)?$/, replacement: 'e2b' }]
  : []
const internal = /from '(\.\.\/)+src\/(?!index\.js'|errors(\.js)?')|from 'msw|vi\.(do)?[mM]ock\(/
const exclude = process.env.E2B_JS_SDK
  ? readdirSync('tests', { recursive: true })
      .map((f) => `tests/${f}`)
      .filter((f) => f.endsWith('.test.ts') && internal.test(readFileSync(f, 'utf8')))
  : []
const node = {
  globals: false,
  isolate: true,
  environment: 'node',
  testTimeout: timeout,
  hookTimeout: timeout,
  exclude,
  setupFiles: ['tests/globalFetchFallback.setup.ts', 'tests/mswEnv.setup.ts'],
  deps: { interopDefault: true },
}

export default defineConfig({
  test: {
    projects: [
      {
        resolve: { alias },
        test: { ...node, name: 'unit', include: ['tests/{api,sandbox,volume}/**/*.test.ts'] },
      },
      {
        resolve: { alias },
        test: { ...node, name: 'template', include: ['tests/template/**/*.test.ts'] },
      },
    ],
  },
})
