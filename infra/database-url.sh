# Sourced by the service scripts. `database_url SCHEME DATABASE` prints the PostgreSQL URL
# of one database from POSTGRES_USER, POSTGRES_PASSWORD and POSTGRES_HOST (default
# postgres:5432), the credentials URL-encoded: a password may hold @, / or :. It refuses
# an unset password and the example's `change-me` (exit 2, one line). POSTGRES_DATABASE_PREFIX
# (default none) lets several stacks share one PostgreSQL server.
database_url() {
    if [ -z "${POSTGRES_USER:-}" ] || [ -z "${POSTGRES_PASSWORD:-}" ]; then
        echo "set POSTGRES_USER and POSTGRES_PASSWORD (copy .env.example to .env and set a password)" >&2
        return 2
    fi
    if [ "$POSTGRES_PASSWORD" = "change-me" ]; then
        echo "POSTGRES_PASSWORD is still the example's 'change-me': set a real password in .env" >&2
        return 2
    fi
    python3 -c 'import sys, urllib.parse
scheme, user, password, host, database = sys.argv[1:]
quote = lambda text: urllib.parse.quote(text, safe="")
print(f"{scheme}://{quote(user)}:{quote(password)}@{host}/{database}")' \
        "$1" "$POSTGRES_USER" "$POSTGRES_PASSWORD" "${POSTGRES_HOST:-postgres:5432}" "${POSTGRES_DATABASE_PREFIX:-}$2"
}
