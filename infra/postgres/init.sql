-- Run once by the postgres image on an empty data volume: one database per service,
-- all owned by the user from .env (POSTGRES_USER).
CREATE DATABASE prefect;
CREATE DATABASE mlflow;
CREATE DATABASE optuna;
