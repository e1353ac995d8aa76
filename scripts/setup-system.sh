#!/usr/bin/env bash
# Installs the system packages the project needs when they are missing (Debian/Ubuntu).
# Idempotent and quiet when everything is present. Needs root (or sudo) only to install.
set -euo pipefail

missing=()
# PostgreSQL server binaries, for the project's own local cluster (when DATABASE_URL is unset).
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  missing+=(postgresql)
fi
# Java and the PostgreSQL JDBC driver, for the Spark jobs (manage.py spark_materialize).
if ! command -v java >/dev/null 2>&1 && [ -z "${JAVA_HOME:-}" ]; then
  missing+=(default-jre-headless)
fi
[ -f /usr/share/java/postgresql.jar ] || missing+=(libpostgresql-jdbc-java)
# Node.js and npm run the official conformance suite and client libraries in the tests.
if [ "${1:-}" = "--test" ]; then
  command -v node >/dev/null 2>&1 || missing+=(nodejs)
  command -v npm >/dev/null 2>&1 || missing+=(npm)
  # Headless Chromium for the browser tests (tests/browser, driven by Playwright).
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
fi

[ ${#missing[@]} -eq 0 ] && exit 0

echo "Installing system packages: ${missing[*]}" >&2
if ! command -v apt-get >/dev/null 2>&1; then
  echo "Please install: ${missing[*]} (no apt-get on this machine)" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "Run as root or install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# Debian starts a system cluster on install; the project runs its own, so stop that one.
if [[ " ${missing[*]} " == *" postgresql "* ]] && command -v pg_ctlcluster >/dev/null 2>&1; then
  $sudo service postgresql stop >/dev/null 2>&1 || true
fi
