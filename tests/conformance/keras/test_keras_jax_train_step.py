"""keras.io's "Customizing what happens in fit() with JAX": a Model subclass whose ``train_step(state, data)``
differentiates ``stateless_call`` with ``jax.value_and_grad``, applies ``optimizer.stateless_apply`` and updates
the metrics statelessly. It is what `openhosti_jax.frontends.keras` points TF-backend ``GradientTape`` loops to, and it
runs under the strategy unchanged."""

import pytest
from _keras_harness import assert_same, blobs, run, weights, worker

pytestmark = pytest.mark.tf  # needs the keras and tf extras


def example(make_strategy, workdir):
    strategy = make_strategy()
    import jax
    import keras

    class CustomModel(keras.Model):
        def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y, training=False):
            y_pred, non_trainable_variables = self.stateless_call(
                trainable_variables, non_trainable_variables, x, training=training
            )
            loss = self.compute_loss(x, y, y_pred)
            return loss, (y_pred, non_trainable_variables)

        def train_step(self, state, data):
            trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
            x, y = data
            grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
            (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
                trainable_variables, non_trainable_variables, x, y, training=True
            )
            trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable_variables
            )
            new_metrics_vars, logs = [], {}
            for metric in self.metrics:
                start = len(new_metrics_vars)
                this_metric_vars = metrics_variables[start : start + len(metric.variables)]
                if metric.name == "loss":
                    this_metric_vars = metric.stateless_update_state(this_metric_vars, loss)
                else:
                    this_metric_vars = metric.stateless_update_state(this_metric_vars, y, y_pred)
                logs[metric.name] = metric.stateless_result(this_metric_vars)
                new_metrics_vars += this_metric_vars
            state = (trainable_variables, non_trainable_variables, optimizer_variables, new_metrics_vars)
            return logs, state

    x, y = blobs(512, (32,))
    with strategy.scope():
        inputs = keras.Input(shape=(32,))
        hidden = keras.layers.Dense(64, activation="relu")(inputs)
        outputs = keras.layers.Dense(10)(hidden)
        model = CustomModel(inputs, outputs)
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    history = model.fit(x, y, batch_size=4 * strategy.num_replicas_in_sync, epochs=3, shuffle=False, verbose=0)
    return {"history": history.history, "weights": weights(model)}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_jax_train_step_matches_one_device(tmp_path):
    out = run(__file__, tmp_path)
    single, mesh = out["single"], out["mesh"]
    assert_same(single, mesh, ["history", "weights"])
    losses = mesh["history"]["loss"]
    assert losses[-1] < 0.5 * losses[0] and mesh["history"]["accuracy"][-1] > 0.5  # chance is 0.1


if __name__ == "__main__":
    worker(example)
