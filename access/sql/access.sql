-- Every change to API keys or their grants tells every server process (access/auth.py drops
-- what it cached of them), on the live-delivery channel, delivered on commit:
-- "auth:key:<prefix>" for each key changed or whose grants changed (one notification per key
-- and transaction: PostgreSQL folds identical ones), "auth:all" for a TRUNCATE.
CREATE OR REPLACE FUNCTION ds_access_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_key text;
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        PERFORM pg_notify('ds_streams', 'auth:all');
        RETURN NULL;
    END IF;
    IF TG_TABLE_NAME = 'ds_api_key' THEN
        v_key := CASE WHEN TG_OP = 'DELETE' THEN OLD.prefix ELSE NEW.prefix END;
        PERFORM pg_notify('ds_streams', 'auth:key:' || v_key);
        IF TG_OP = 'UPDATE' AND OLD.prefix IS DISTINCT FROM NEW.prefix THEN
            PERFORM pg_notify('ds_streams', 'auth:key:' || OLD.prefix);
        END IF;
    ELSE
        -- A grant names its key by id, "<prefix>.<hash>".
        v_key := split_part(CASE WHEN TG_OP = 'DELETE' THEN OLD.key_id ELSE NEW.key_id END,
                            '.', 1);
        PERFORM pg_notify('ds_streams', 'auth:key:' || v_key);
        IF TG_OP = 'UPDATE' AND OLD.key_id IS DISTINCT FROM NEW.key_id THEN
            PERFORM pg_notify('ds_streams', 'auth:key:' || split_part(OLD.key_id, '.', 1));
        END IF;
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS ds_api_key_changed ON ds_api_key;
CREATE TRIGGER ds_api_key_changed AFTER INSERT OR UPDATE OR DELETE ON ds_api_key
    FOR EACH ROW EXECUTE FUNCTION ds_access_changed();
DROP TRIGGER IF EXISTS ds_api_key_truncated ON ds_api_key;
CREATE TRIGGER ds_api_key_truncated AFTER TRUNCATE ON ds_api_key
    FOR EACH STATEMENT EXECUTE FUNCTION ds_access_changed();
DROP TRIGGER IF EXISTS ds_api_grant_changed ON ds_api_grant;
CREATE TRIGGER ds_api_grant_changed AFTER INSERT OR UPDATE OR DELETE ON ds_api_grant
    FOR EACH ROW EXECUTE FUNCTION ds_access_changed();
DROP TRIGGER IF EXISTS ds_api_grant_truncated ON ds_api_grant;
CREATE TRIGGER ds_api_grant_truncated AFTER TRUNCATE ON ds_api_grant
    FOR EACH STATEMENT EXECUTE FUNCTION ds_access_changed();
