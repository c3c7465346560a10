// E2B's mocked tests (msw) mock https://api.<E2B_DOMAIN>; with E2B_API_URL pointing at agentenv, the SDK would
// bypass the mocks. While an msw server listens, the URL variables are unset, so those tests talk to their mocks
// and the rest of a file (tags.test.ts mixes both) to the server. run.sh copies this file beside the tests.
import { vi } from 'vitest'

vi.mock('msw/node', async (importOriginal) => {
  const msw = await importOriginal<typeof import('msw/node')>()
  const keys = ['E2B_API_URL', 'E2B_SANDBOX_URL']
  const setupServer: typeof msw.setupServer = (...handlers) => {
    const server = msw.setupServer(...handlers)
    const { listen, close } = server
    const saved: Record<string, string | undefined> = {}
    server.listen = (...args) => {
      for (const k of keys) {
        saved[k] = process.env[k]
        delete process.env[k]
      }
      return listen.apply(server, args)
    }
    server.close = () => {
      for (const k of keys) if (saved[k] !== undefined) process.env[k] = saved[k]
      return close.apply(server)
    }
    return server
  }
  return { ...msw, setupServer }
})
