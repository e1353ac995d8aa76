-- Every change to API keys or their grants tells every server process (access/auth.py drops
-- its cache of keys): "auth:<table>" on the live-delivery channel, delivered on commit.
CREATE OR REPLACE FUNCTION ds_access_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('ds_streams', 'auth:' || TG_TABLE_NAME);
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS ds_api_key_changed ON ds_api_key;
CREATE TRIGGER ds_api_key_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON ds_api_key
    FOR EACH STATEMENT EXECUTE FUNCTION ds_access_changed();
DROP TRIGGER IF EXISTS ds_api_grant_changed ON ds_api_grant;
CREATE TRIGGER ds_api_grant_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON ds_api_grant
    FOR EACH STATEMENT EXECUTE FUNCTION ds_access_changed();
