"""``providers``: outbounds and rule sets the engine fetches (subscriptions) or reads from files.

A provider's content is not part of the configuration document: the document names where
it comes from (``url`` or ``path``), how often it is refreshed and how it is read. The
engine keeps the last good copy of every fetched provider on disk
(``runtime.providers_cache_dir``), so it starts offline from that copy.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from spliceway.config.validators import (
    NonEmptyStr,
    PosInt,
    ProbeUrl,
    RegexList,
    SBool,
    SStr,
    Tag,
    _Model,
)

#: Providers' names: the same shape as tags (groups list them in ``providers``).
ProviderName = Tag

#: 32 MiB: a bigger subscription or rule set is refused unless configured otherwise.
DEFAULT_SIZE_LIMIT = 32 * 1024 * 1024


def _one_source(data: Any) -> Any:
    if isinstance(data, dict) and (data.get("url") is None) == (data.get("path") is None):
        raise ValueError("give exactly one of `url` and `path`")
    return data


class ProviderHealthCheck(_Model):
    """``health_check``: probing a proxy provider's outbounds outside any group."""

    enabled: SBool = False
    """Probe every outbound of the provider every `interval_seconds`: each result is the
    outbound's latest health (the policy views' `member_health`, the Clash API's
    history); the groups' selection follows their own probe rounds."""
    url: ProbeUrl | None = None
    """URL probed through each outbound. `null` uses `runtime.latency_test_url`, else
    `http://www.gstatic.com/generate_204`."""
    interval_seconds: PosInt = 300
    """Seconds between probe rounds."""


class ProviderOverride(_Model):
    """``override``: changes applied to every outbound a proxy provider yields."""

    name_prefix: SStr = ""
    """Text put before every outbound's name (its tag)."""
    name_suffix: SStr = ""
    """Text put after every outbound's name (its tag)."""
    connect_timeout_ms: PosInt | None = None
    """Connect budget of every outbound, in milliseconds; `null` keeps each one's own."""


class ProxyProvider(_Model):
    """``providers.proxies.<name>``: outbounds from a subscription URL or a file."""

    url: Annotated[str, Field(pattern=r"^https?://")] | None = None
    """`http://` or `https://` URL the content is fetched from (through `via`)."""
    path: NonEmptyStr | None = None
    """File the content is read from (re-read on `interval_seconds` and
    `providers.update`)."""
    interval_seconds: PosInt = 3600
    """Seconds between refreshes; a failed refresh keeps the last good copy."""
    format: Literal["clash", "links", "spliceway"] | None = None
    """How the content is read: `clash` (a YAML document with a `proxies:` list),
    `links` (share links, one per line, optionally base64-encoded as a whole) or
    `spliceway` (a JSON or YAML document with an `outbounds` list). `null`: detected from
    the content."""
    via: Tag | None = None
    """Outbound or group tag the content is fetched through; `null`: the built-in `direct`
    outbound."""
    size_limit_bytes: PosInt = DEFAULT_SIZE_LIMIT
    """A response body larger than this is refused (the last good copy is kept)."""
    filter: RegexList | None = None
    """Only outbounds whose name matches one of these regular expressions (searched,
    Python `re` syntax) are kept."""
    exclude_filter: RegexList | None = None
    """Outbounds whose name matches one of these regular expressions are dropped."""
    health_check: ProviderHealthCheck = Field(default_factory=ProviderHealthCheck)
    """Probing the provider's outbounds."""
    override: ProviderOverride = Field(default_factory=ProviderOverride)
    """Changes applied to every outbound."""

    _source = model_validator(mode="before")(_one_source)


class RuleProvider(_Model):
    """``providers.rules.<name>``: a rule set from a URL or a file, matched by ``rule_set``."""

    url: Annotated[str, Field(pattern=r"^https?://")] | None = None
    """`http://` or `https://` URL the rule set is fetched from (through `via`)."""
    path: NonEmptyStr | None = None
    """File the rule set is read from (re-read on `interval_seconds` and
    `providers.update`)."""
    interval_seconds: PosInt = 86400
    """Seconds between refreshes; a failed refresh keeps the last good copy."""
    behavior: Literal["domain", "ipcidr", "classical"]
    """What the entries are: `domain` (names: `example.com` exactly, `+.example.com` the
    name and every subdomain, `.example.com` subdomains only, `*.example.com` one label
    below), `ipcidr` (networks), `classical` (Clash rule lines without a target, such as
    `DOMAIN-SUFFIX,example.com` or `IP-CIDR,10.0.0.0/8,no-resolve`)."""
    format: Literal["text", "yaml", "mrs"] = "yaml"
    """`yaml` (a document with a `payload:` list), `text` (one entry per line, `#`
    comments) or `mrs` (mihomo's binary format)."""
    via: Tag | None = None
    """Outbound or group tag the rule set is fetched through; `null`: the built-in `direct`
    outbound."""
    size_limit_bytes: PosInt = DEFAULT_SIZE_LIMIT
    """A response body larger than this is refused (the last good copy is kept)."""

    _source = model_validator(mode="before")(_one_source)


class Providers(_Model):
    """``providers``: proxy providers (outbounds) and rule providers (rule sets), by name."""

    proxies: dict[ProviderName, ProxyProvider] = Field(default_factory=dict)
    """Proxy providers: groups list their names in `providers`, and every outbound the
    provider yields becomes a member."""
    rules: dict[ProviderName, RuleProvider] = Field(default_factory=dict)
    """Rule providers: rules name them in `rule_set`."""
