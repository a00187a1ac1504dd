-- The role every part of the stack but the migration connects as (README, "Deployment"):
-- made here if missing (each `up`: a volume made before this file too), its password set to
-- the stack's; it owns nothing and may do nothing until `db upgrade --grant toolledger_app`
-- (the migrate service) lets it read and write the ledger's rows.
-- psql -v app_password=... -f roles.sql
SELECT format('CREATE ROLE toolledger_app LOGIN PASSWORD %L', :'app_password')
 WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'toolledger_app') \gexec
SELECT format('ALTER ROLE toolledger_app LOGIN PASSWORD %L', :'app_password') \gexec
