// Preloaded into node (NODE_OPTIONS=--require): resolves the suite's sandbox domain and every name under
// it (E2B_SUITE_DOMAIN, server.sh) to loopback, as a deployment's wildcard DNS name resolves to its server.
const dns = require('dns')
const domain = process.env.E2B_SUITE_DOMAIN
const lookup = dns.lookup
dns.lookup = function (host, opts, cb) {
  if (typeof opts === 'function') [cb, opts] = [opts, {}]
  if (domain && typeof host === 'string' && (host === domain || host.endsWith('.' + domain))) {
    if (opts && opts.all) return process.nextTick(cb, null, [{ address: '127.0.0.1', family: 4 }])
    return process.nextTick(cb, null, '127.0.0.1', 4)
  }
  return lookup.call(this, host, opts, cb)
}
