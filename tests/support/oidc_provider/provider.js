// A real OpenID provider for the single sign-on tests: panva's certified oidc-provider, started as
// its own process by tests/support/oidc.py. Everything it knows comes from files the test writes:
//   OIDC_PORT      the port on 127.0.0.1 (the issuer is http://127.0.0.1:PORT)
//   OIDC_JWKS      a JSON file with the private signing keys ({"keys": [...]}), so a test can also
//                  sign tokens with the provider's own key (another audience, expired)
//   OIDC_CLIENTS   a JSON file with the registered clients
//   OIDC_ACCOUNTS  a JSON file {"alice": {"email": ..., "groups": [...]}, ...}, read again at every
//                  use, so a test removes someone from a group by rewriting it
// Sign-in is the library's development interaction: any password, the login names the account.
// Consent is granted without asking: the tests are about the relying party, not about consent.
import { readFileSync } from 'node:fs';
import Provider from 'oidc-provider';

const port = Number(process.env.OIDC_PORT);
const readJson = (path) => JSON.parse(readFileSync(path, 'utf8'));
const issuer = `http://127.0.0.1:${port}`;

const configuration = {
  clients: readJson(process.env.OIDC_CLIENTS),
  jwks: readJson(process.env.OIDC_JWKS),
  claims: {
    openid: ['sub'],
    email: ['email', 'email_verified'],
    profile: ['name', 'preferred_username'],
    groups: ['groups'],
  },
  async findAccount(ctx, id) {
    const account = readJson(process.env.OIDC_ACCOUNTS)[id];
    if (!account) return undefined;
    return {
      accountId: id,
      async claims() {
        return {
          sub: id,
          preferred_username: id,
          name: account.name || id,
          email: account.email || `${id}@example.org`,
          email_verified: true,
          groups: account.groups || [],
        };
      },
    };
  },
  async loadExistingGrant(ctx) {
    const grantId = ctx.oidc.result?.consent?.grantId || ctx.oidc.session.grantIdFor(ctx.oidc.client.clientId);
    if (grantId) return ctx.oidc.provider.Grant.find(grantId);
    const grant = new ctx.oidc.provider.Grant({ clientId: ctx.oidc.client.clientId, accountId: ctx.oidc.session.accountId });
    grant.addOIDCScope('openid email profile groups offline_access');
    grant.addOIDCClaims(['groups', 'email', 'preferred_username']);
    await grant.save();
    return grant;
  },
  issueRefreshToken: async (ctx, client) => client.grantTypeAllowed('refresh_token'),
  pkce: { required: () => true },
  features: {
    devInteractions: { enabled: true },
    deviceFlow: { enabled: true },
    revocation: { enabled: true },
  },
  ttl: {
    AccessToken: Number(process.env.OIDC_ACCESS_TOKEN_TTL || 600),
    IdToken: 600,
    DeviceCode: 600,
    Interaction: 600,
    Session: 3600,
    Grant: 3600,
    RefreshToken: 3600,
    AuthorizationCode: 60,
  },
};

const provider = new Provider(issuer, configuration);
provider.listen(port, '127.0.0.1', () => {
  console.log(`oidc-provider listening on ${issuer}`);
});
